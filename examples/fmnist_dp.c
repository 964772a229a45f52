/* examples/fmnist_dp.c: data-parallel training of the Fashion-MNIST MLP on N ranks.
 *
 * What it shows: the same program trains on N ranks instead of one by adding a process
 * group (dtr_comm) and the data-parallel engine (dtr_dp):
 *   - every rank builds the same model; dtr_dp_create broadcasts rank 0's parameters;
 *   - a distributed sampler (dtr_sampler) gives each rank its shard of a per-epoch shuffle,
 *     the same number of batches on every rank;
 *   - each rank runs forward and backward on its share of the global batch; during
 *     backward the gradient buckets are averaged across ranks in the background, and
 *     dtr_dp_finish waits for them; then every rank applies the same optimizer step;
 *   - the epoch's loss and accuracy are summed over the ranks with dtr_comm_all_reduce.
 * With the local transport the ranks are threads of this process (one compute thread
 * each). With another transport (--transport libfabric, from dtrain_comm.c) each process is
 * one rank, started by the launcher: `dtrun -n 2 build/examples/fmnist_dp --transport
 * libfabric`. Every call is checked; errors print the group's or context's message.
 *
 * Build and run from the repository:
 *     make examples && build/examples/fmnist_dp [DATA_DIR] [--world 2] [options]
 * By hand, with dtrain.h, common.h and ranks.h beside this file:
 *     cc -O2 -march=native -I. -DDTRAIN_IMPLEMENTATION -DDTR_USE_ZLIB fmnist_dp.c \
 *        -o fmnist_dp -lm -lpthread -lz
 *
 * Usage: fmnist_dp [DATA_DIR] [--world N] [--transport NAME] [--provider P] [--epochs E]
 *                  [--batch B] [--lr LR] [--schedule cosine|constant] [--seed S]
 *                  [--bucket BYTES] [--threads T] [--compress none|bf16|fp16|int8|topk|powersgd]
 *                  [--topk-ratio F] [--powersgd-rank R] [--local-sgd H] [--local-sgd-warmup W] [--zero 0|1|2|3]
 *                  [--zero3-keep-grads 0|1] [--zero2-release-grads 0|1] [--graph]
 *                  [--freeze PREFIX] [--find-unused 0|1] [--metrics FILE] [--trace FILE]
 *   --world      ranks (local transport; default 2)
 *   --transport  local (default) or a registered transport such as libfabric
 *   --batch      global batch, split evenly over the ranks (default 128)
 *   --lr         SGD learning rate, momentum 0.9 (default 0.1)
 *   --bucket     gradient bucket bytes (default 64 KiB: the MLP's 0.9 MiB of gradients make
 *                2 buckets, fc3+fc2 and fc1, so fc2/fc3's average overlaps fc1's backward)
 *   --threads    compute threads per rank (default 1)
 *   --compress   gradient compression of the engine (dtr_dp_config.compress; default none)
 *   --local-sgd  H > 0: local SGD, parameters averaged every H steps after W warm-up steps of
 *                ordinary DP (dtr_dp_step_done after each optimizer step)
 *   --zero 1     ZeRO-1: each rank updates (and keeps optimizer state for) its shard of the
 *                parameters; dtr_dp_step_done gathers the shards
 *   --zero 2     ZeRO-2: as 1, and each rank receives only its shard's gradients (sent to it
 *                during backward: half the bytes of an all-reduce)
 *   --zero 3     ZeRO-3: as 2, and the parameters stay sharded: each bucket is gathered when
 *                forward or backward reads it (dtr_dp_gather_params before the evaluation)
 *   --zero3-keep-grads 1  ZeRO-3: keep the whole gradient buffer resident (faster, more memory)
 *   --zero2-release-grads 1  ZeRO-2: give the gradients outside the shard back once sent (less
 *                memory between steps, page faults each backward)
 *   --find-unused 1  the engine asks which parameters some rank's backward reached (one more
 *                all-reduce a step; the optimizer leaves out the others, as one process does)
 *   --freeze     the parameters whose names start with PREFIX stay as initialised
 *                (dtr_model_set_trainable; "fc1." fine-tunes fc2 and fc3 only): no gradient, no
 *                optimizer state, not in any bucket (their floats never go on the wire)
 *   --graph      the forward and backward of each full batch captured once (dtr_graph_capture; a
 *                CUDA graph with --gpu) and launched; dtr_dp_finish then exchanges every bucket
 *                (no overlap with backward). Not with ZeRO-3 (refused)
 *   --metrics    each rank appends a JSON line per step to FILE (with .rank<r> before its
 *                extension: m.jsonl -> m.rank1.jsonl); the step time is split into data,
 *                forward, backward, exposed communication, optimizer (docs/observability.md)
 *   --trace      each rank writes a Perfetto timeline (t.json -> t.rank0.json ...); merge them
 *                with `dtrun --merge-traces t.json t.rank0.json t.rank1.json`
 * Other options as examples/fmnist_mlp.c. Expect about 87% test accuracy after 2 epochs,
 * as the single-rank example with the same global batch. */
#include "common.h"
#include "ranks.h"

/* ---- options and results ---- */

typedef struct dp_opts {
    const char *dir, *transport, *provider;
    int world, epochs, batch, threads, cosine, quiet;
    float lr;
    unsigned long seed;
    size_t bucket;
    int64_t max_steps;      /* > 0: steps per epoch at most (benchmarks) */
    dtr_dp_compress compress;
    int zero;               /* 1: ZeRO-1, 2: ZeRO-2, 3: ZeRO-3 */
    int zero3_keep_grads;   /* ZeRO-3: the whole gradient buffer stays resident */
    int zero2_release_grads; /* ZeRO-2: the gradients outside the shard given back once sent */
    int find_unused;        /* --find-unused: dtr_dp_config.find_unused */
    float topk_ratio;
    int powersgd_rank, local_sgd;
    int64_t local_sgd_warmup;
    const char *metrics, *trace;   /* --metrics FILE, --trace FILE: per rank (run.json -> run.rank1.json) */
    int gpu;                /* --gpu: every rank trains on the GPU (make examples-gpu) */
    int graph;              /* --graph: the forward and backward of full batches captured once and launched */
    const char *freeze;     /* --freeze PREFIX: those parameters frozen (fine-tuning the rest) */
} dp_opts;

typedef struct dp_result {
    double train_s;         /* training steps only, slowest rank */
    int64_t samples, steps; /* over all ranks / per rank */
    double loss, train_acc, test_acc;
    int buckets, overlapped;
    dtr_dp_stats stats;     /* rank 0's engine counters */
    size_t opt_state_bytes; /* rank 0's optimizer state (momentum: its shard with --zero 1 or 2) */
    int ok;
} dp_result;

static dp_opts dp_opts_default(void) {
    dp_opts o;
    memset(&o, 0, sizeof o);
    o.transport = "local";
    o.world = 2;
    o.epochs = 2;
    o.batch = 128;
    o.threads = 1;
    o.cosine = 1;
    o.lr = 0.1f;
    o.seed = 1;
    o.bucket = (size_t)64 << 10;
    return o;
}

static int dp_err(int rank, const char *what, dtr_result r, const char *msg) {
    fprintf(stderr, "rank %d: error: %s: %s%s%s%s\n", rank, what, dtr_result_string(r), msg && *msg ? " (" : "",
            msg ? msg : "", msg && *msg ? ")" : "");
    return 0;
}

/* ---- one rank's training ---- */

static dtr_tensor *dp_forward(dtr_context *ctx, const void *net, dtr_tensor *x) {
    return fm_net_forward(ctx, (const fm_net *)net, x);
}

/* Trains on `data` as rank dtr_comm_rank(c) of the group. Rank 0 fills `res` (and prints
   progress unless o->quiet). Returns 1 on success. */
static int dp_rank_train(dtr_comm *c, const dp_opts *o, const dtr_mnist *data, dp_result *res) {
    int rank = dtr_comm_rank(c), world = dtr_comm_size(c), per = o->batch / world, ok = 0, e;
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_dp *dp = NULL;
    dtr_optimizer *opt = NULL;
    dtr_optimizer_config oc;
    dtr_metrics *metrics = NULL;
    dtr_sampler smp;
    fm_net net;
    fm_graph_step gs = {dp_forward, &net, NULL, NULL, NULL, NULL, NULL, NULL};
    fm_batch batch, eval;
    int64_t *idx = NULL, *scratch = NULL, count, steps;
    double train_s = 0.0;
    fm_progress prog;
    float sums[3];
    dtr_result r;

    memset(&net, 0, sizeof net);
    memset(&batch, 0, sizeof batch);
    memset(&eval, 0, sizeof eval);
    if (per < 1 || per * world != o->batch) {
        fprintf(stderr, "rank %d: error: the global batch %d must be a multiple of the %d ranks: pass --batch %d "
                "or --batch %d (make demo: DEMO_BATCH=%d), or a rank count that divides %d\n", rank, o->batch, world,
                (o->batch / world) * world > 0 ? (o->batch / world) * world : world, (o->batch / world + 1) * world,
                (o->batch / world + 1) * world, o->batch);
        dtr_comm_abort(c, "bad batch size");
        return 0;
    }
    cc.threads = o->threads;
    cc.seed = o->seed + (uint64_t)rank;   /* dropout streams would differ per rank (unused by the MLP) */
    if (!fm_backend(o->gpu, &cc)) { dtr_comm_abort(c, "no GPU backend"); return 0; }
    if ((r = dtr_context_create(&cc, &ctx)) != DTR_OK) { dtr_comm_abort(c, "no context"); return dp_err(rank, "context", r, NULL); }
    if ((r = dtr_sampler_init(&smp, data->train_n, rank, world, o->seed, 1, 0)) != DTR_OK) { dp_err(rank, "sampler", r, NULL); goto done; }
    count = dtr_sampler_count(&smp);
    steps = (count + per - 1) / per;
    if (o->max_steps > 0 && steps > o->max_steps) steps = o->max_steps;
    idx = (int64_t *)malloc((size_t)count * sizeof(int64_t));
    scratch = (int64_t *)malloc((size_t)data->train_n * sizeof(int64_t));
    if (!idx || !scratch || fm_batch_alloc(&batch, per) != DTR_OK || fm_batch_alloc(&eval, 1000) != DTR_OK) {
        dtr_comm_abort(c, "out of memory");
        dp_err(rank, "memory", DTR_OUT_OF_MEMORY, NULL);
        goto done;
    }
    /* the same model on every rank; dtr_dp_create makes rank 0's parameters everyone's */
    if ((r = fm_net_init(&net, ctx, FM_MLP, DTR_INIT_KAIMING_UNIFORM, o->seed)) != DTR_OK) { dp_err(rank, "model", r, dtr_context_last_error(ctx)); goto done; }
    if (o->freeze && (r = dtr_model_set_trainable(net.model, &o->freeze, 1, 0)) != DTR_OK) { dp_err(rank, "--freeze", r, dtr_context_last_error(ctx)); goto done; }
    dc.bucket_bytes = o->bucket;
    dc.compress = o->compress;
    dc.topk_ratio = o->topk_ratio;
    dc.powersgd_rank = o->powersgd_rank;
    dc.local_sgd_every = o->local_sgd;
    dc.local_sgd_warmup = o->local_sgd_warmup;
    dc.zero = o->zero;
    dc.zero3_keep_grads = o->zero3_keep_grads;
    dc.zero2_release_grads = o->zero2_release_grads;
    dc.find_unused = o->find_unused;
    if ((r = dtr_dp_create(net.model, c, &dc, &dp)) != DTR_OK) { dp_err(rank, "dtr_dp_create", r, dtr_context_last_error(ctx)); goto done; }
    oc = fm_sgd_config(o->lr, 0.9f, o->cosine ? o->epochs * steps : 0);
    dtr_dp_shard_optimizer(dp, &oc);   /* ZeRO: this rank's shard; else all */
    if ((r = dtr_optimizer_create(net.model, &oc, &opt)) != DTR_OK) { dp_err(rank, "optimizer", r, dtr_context_last_error(ctx)); goto done; }
    if ((r = fm_metrics_open(ctx, o->metrics, o->trace, rank, world, &metrics)) != DTR_OK) { dp_err(rank, "metrics", r, dtr_context_last_error(ctx)); goto done; }
    if (rank == 0 && !o->quiet)
        printf("fmnist_dp: %d ranks over '%s', global batch %d (%d per rank), %lld steps per epoch, %d gradient "
               "buckets\n", world, dtr_comm_transport_name(c), o->batch, per, (long long)steps, dtr_dp_bucket_count(dp));

    fm_progress_init(&prog, 50);
    for (e = 0; e < o->epochs; e++) {
        double loss_sum = 0.0, t0;
        int64_t correct = 0, seen = 0, s, i;
        if ((r = dtr_sampler_epoch(&smp, e, idx, scratch, NULL)) != DTR_OK) { dp_err(rank, "sampler", r, NULL); goto done; }
        if ((r = dtr_comm_barrier(c)) != DTR_OK) { dp_err(rank, "barrier", r, dtr_comm_last_error(c)); goto done; }
        t0 = fm_now();
        if (metrics) dtr_metrics_step_begin(metrics);   /* the epoch's barrier is not in a step */
        dtr_context_set_training(ctx, 1);
        for (s = 0; s < steps; s++) {
            int64_t B = count - s * per < per ? count - s * per : per, xs[2], ys[1];
            dtr_tensor *x, *y, *logits, *loss = NULL;
            dtr_step_info info = {0};
            if (metrics) dtr_metrics_phase_begin(metrics, DTR_PHASE_DATA);   /* this loop's own batching */
            for (i = 0; i < B; i++) {
                int64_t k = idx[s * per + i];
                memcpy(batch.x + i * FM_PIXELS, data->train_x + k * FM_PIXELS, FM_PIXELS * sizeof(float));
                batch.y[i] = data->train_y[k];
            }
            xs[0] = B; xs[1] = FM_PIXELS; ys[0] = B;
            if (metrics) dtr_metrics_phase_end(metrics, DTR_PHASE_DATA);
            x = dtr_tensor_from(ctx, DTR_F32, 2, xs, batch.x);
            y = dtr_tensor_from(ctx, DTR_I32, 1, ys, batch.y);
            if (o->graph && B == per) {   /* --graph: the captured step; finish exchanges every bucket */
                r = fm_graph_run(ctx, &gs, x, y, &loss);
                logits = gs.logits;
            } else {   /* backward starts the buckets' all-reduces; finish waits for the averages */
                logits = fm_net_forward(ctx, &net, x);
                loss = dtr_cross_entropy(ctx, logits, y);
                r = loss ? dtr_backward(ctx, loss) : dtr_context_status(ctx);
            }
            if (r == DTR_OK) r = dtr_dp_finish(dp);
            if (r != DTR_OK) {
                dp_err(rank, "step", r, dtr_context_last_error(ctx));
                goto done;
            }
            if ((r = dtr_tensor_read(logits, DTR_F32, batch.logits, (size_t)(B * FM_CLASSES))) != DTR_OK) goto done;
            info.loss = (double)dtr_tensor_get(loss, 0);
            loss_sum += info.loss * (double)B;
            correct += fm_count_correct(batch.logits, batch.y, B);
            seen += B;
            if (rank == 0 && !o->quiet)   /* rank 0's loss and rate, times the ranks */
                fm_progress_step(&prog, e, o->epochs, s + 1, steps, B * world, dtr_tensor_get(loss, 0));
            if ((r = dtr_optimizer_step(opt, NULL)) != DTR_OK || (r = dtr_dp_step_done(dp)) != DTR_OK ||
                (r = dtr_context_reset(ctx)) != DTR_OK) {
                dp_err(rank, "optimizer", r, dtr_context_last_error(ctx));
                goto done;
            }
            info.samples = B;
            info.epoch = e;
            if (metrics && (r = dtr_metrics_step_end(metrics, &info, NULL)) != DTR_OK) { dp_err(rank, "metrics", r, dtr_context_last_error(ctx)); goto done; }
        }
        if (rank == 0 && !o->quiet) fm_progress_clear(&prog);
        if ((r = dtr_comm_barrier(c)) != DTR_OK) { dp_err(rank, "barrier", r, dtr_comm_last_error(c)); goto done; }
        train_s += fm_now() - t0;
        /* epoch statistics over all ranks */
        sums[0] = (float)loss_sum;
        sums[1] = (float)correct;
        sums[2] = (float)seen;
        if ((r = dtr_comm_all_reduce(c, sums, sums, 3, DTR_F32, DTR_REDUCE_SUM)) != DTR_OK) {
            dp_err(rank, "all_reduce", r, dtr_comm_last_error(c));
            goto done;
        }
        if (rank == 0) {
            res->loss = sums[0] / sums[2];
            res->train_acc = sums[1] / sums[2];
            res->samples += (int64_t)sums[2];
            if (!o->quiet) {
                printf("epoch %2d  loss %.4f  train acc %.2f%%  %.1f s  %.0f samples/s\n", e + 1, res->loss,
                       100.0 * res->train_acc, fm_now() - t0, sums[2] / (fm_now() - t0));
                fflush(stdout);
            }
        }
    }
    /* ZeRO-3: every rank gathers the whole model, so rank 0 may evaluate alone */
    if ((r = dtr_dp_gather_params(dp)) != DTR_OK) { dp_err(rank, "gather", r, dtr_context_last_error(ctx)); goto done; }
    if (rank == 0) {
        res->train_s = train_s;
        res->steps = steps * o->epochs;
        res->buckets = dtr_dp_bucket_count(dp);
        res->overlapped = dtr_dp_overlapped_buckets(dp);
        dtr_dp_get_stats(dp, &res->stats);
        res->opt_state_bytes = dtr_optimizer_state_bytes(opt);
        if ((r = fm_evaluate(ctx, &net, data->test_x, data->test_y, data->test_n, &eval, &res->test_acc)) != DTR_OK) {
            dp_err(rank, "evaluation", r, dtr_context_last_error(ctx));
            goto done;
        }
        res->ok = 1;
    }
    ok = 1;
done:
    if (!ok) dtr_comm_abort(c, "training stopped");   /* the other ranks stop at once */
    dtr_metrics_destroy(metrics);   /* writes the timeline */
    fm_graph_free(&gs);
    dtr_dp_destroy(dp);
    dtr_optimizer_destroy(opt);
    fm_net_free(&net);
    fm_batch_free(&batch);
    fm_batch_free(&eval);
    free(idx);
    free(scratch);
    dtr_context_destroy(ctx);
    return ok;
}

/* ---- ranks as threads (local transport) or as processes (launcher): ranks.h ---- */

typedef struct dp_job { const dp_opts *o; const dtr_mnist *data; dp_result *res; } dp_job;

static int dp_job_rank(dtr_comm *c, void *user) {
    dp_job *j = (dp_job *)user;
    return dp_rank_train(c, j->o, j->data, j->res);
}

/* Trains with o->world rank threads (local) or as this process's rank (other transports).
   Returns 1 on success; res is rank 0's view (all zero on other processes). */
static int dp_train(const dp_opts *o, const dtr_mnist *data, dp_result *res) {
    dp_job j;
    memset(res, 0, sizeof *res);
    j.o = o, j.data = data, j.res = res;
    return ex_run_ranks("fmnist_dp", o->transport, o->provider, o->world, !o->quiet, dp_job_rank, &j);
}

/* the --compress names, in dtr_dp_compress order */
static const char *const dp_compress_names[] = {"none", "bf16", "fp16", "int8", "topk", "powersgd"};

/* options shared with bench/fmnist_dp.c; returns 1 when `a` was one of them (0 otherwise,
   -1 for a bad value) */
static int dp_parse_compress(dp_opts *o, const char *a, const char *v) {
    char *end = NULL;
    int i;
    if (!strcmp(a, "--freeze")) {
        o->freeze = v;
        return 1;
    }
    if (!strcmp(a, "--compress")) {
        for (i = 0; i < 6; i++)
            if (!strcmp(v, dp_compress_names[i])) { o->compress = (dtr_dp_compress)i; return 1; }
        fprintf(stderr, "error: --compress %s: none, bf16, fp16, int8, topk or powersgd\n", v);
        return -1;
    }
    if (!strcmp(a, "--topk-ratio")) o->topk_ratio = strtof(v, &end);
    else if (!strcmp(a, "--powersgd-rank")) o->powersgd_rank = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--local-sgd")) o->local_sgd = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--local-sgd-warmup")) o->local_sgd_warmup = strtol(v, &end, 10);
    else if (!strcmp(a, "--zero")) o->zero = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--zero3-keep-grads")) o->zero3_keep_grads = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--zero2-release-grads")) o->zero2_release_grads = (int)strtol(v, &end, 10);
    else if (!strcmp(a, "--find-unused")) o->find_unused = (int)strtol(v, &end, 10);
    else return 0;
    if (!end || *end || end == v) { fprintf(stderr, "error: %s: '%s' is not a number\n", a, v); return -1; }
    return 1;
}

#ifndef FMNIST_DP_NO_MAIN
int main(int argc, char **argv) {
    dp_opts o = dp_opts_default();
    dtr_mnist data;
    dp_result res;
    int i, k;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("usage: %s [DATA_DIR] [--world N] [--transport NAME] [--provider P] [--epochs E] [--batch B] "
                   "[--lr LR] [--schedule cosine|constant] [--seed S] [--bucket BYTES] [--threads T] "
                   "[--compress none|bf16|fp16|int8|topk|powersgd] [--topk-ratio F] [--powersgd-rank R] "
                   "[--local-sgd H] [--local-sgd-warmup W] [--zero 0|1|2|3] [--zero3-keep-grads 0|1] "
                   "[--zero2-release-grads 0|1] [--find-unused 0|1] [--gpu] [--graph] [--freeze PREFIX]\n", argv[0]);
            return 0;
        }
        if (a[0] != '-') { o.dir = a; continue; }
        if (!strcmp(a, "--gpu")) { o.gpu = 1; continue; }
        if (!strcmp(a, "--graph")) { o.graph = 1; continue; }
        if (!v) { fprintf(stderr, "error: %s needs a value\n", a); return 2; }
        i++;
        if (!strcmp(a, "--transport")) { o.transport = v; continue; }
        if (!strcmp(a, "--metrics")) { o.metrics = v; continue; }
        if (!strcmp(a, "--trace")) { o.trace = v; continue; }
        if (!strcmp(a, "--provider")) { o.provider = v; continue; }
        if (!strcmp(a, "--schedule")) { o.cosine = strcmp(v, "constant") != 0; continue; }
        if ((k = dp_parse_compress(&o, a, v)) != 0) { if (k < 0) return 2; continue; }
        if (!strcmp(a, "--world")) o.world = (int)strtol(v, &end, 10);
        else if (!strcmp(a, "--epochs")) o.epochs = (int)strtol(v, &end, 10);
        else if (!strcmp(a, "--batch")) o.batch = (int)strtol(v, &end, 10);
        else if (!strcmp(a, "--threads")) o.threads = (int)strtol(v, &end, 10);
        else if (!strcmp(a, "--lr")) o.lr = strtof(v, &end);
        else if (!strcmp(a, "--seed")) o.seed = strtoul(v, &end, 10);
        else if (!strcmp(a, "--bucket")) o.bucket = (size_t)strtoull(v, &end, 10);
        else { fprintf(stderr, "error: unknown option %s\n", a); return 2; }
        if (!end || *end || end == v) { fprintf(stderr, "error: %s: '%s' is not a number\n", a, v); return 2; }
    }
    if (o.world < 1 || o.epochs < 1 || o.batch < 1 || o.threads < 0 || !(o.lr > 0.0f)) {
        fprintf(stderr, "error: need --world >= 1, --epochs >= 1, --batch >= 1, --threads >= 0, --lr > 0\n");
        return 2;
    }
    o.dir = fm_data_dir(o.dir);
    if (fm_data_load(o.dir, &data) != DTR_OK) return 1;
    if (!dp_train(&o, &data, &res)) { dtr_mnist_destroy(&data); return 1; }
    if (res.ok)   /* rank 0 */
        printf("final test accuracy: %.2f%% (%d of %d gradient buckets started during backward)\n", 100.0 * res.test_acc,
               res.overlapped, res.buckets);
    if (res.ok && res.steps > 0)
        printf("%s: %.0f bytes per step on the wire (f32: %.0f)\n", dp_compress_names[o.compress],
               (double)res.stats.wire_bytes / (double)res.steps, (double)res.stats.raw_bytes / (double)res.steps);
    dtr_mnist_destroy(&data);
    return 0;
}
#endif
