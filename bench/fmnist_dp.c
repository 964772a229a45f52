/* bench/fmnist_dp.c: data-parallel training throughput on Fashion-MNIST.
 *
 *   build/bench/fmnist_dp [--world 1,2] [--transport local|NAME] [--provider P]
 *                         [--epochs E] [--batches K] [--batch B] [--bucket BYTES]
 *                         [--data DIR] [--seed S] [--repeat R]
 *                         [--compress none|bf16|fp16|int8|topk|powersgd] [--topk-ratio F]
 *                         [--powersgd-rank R] [--local-sgd H] [--local-sgd-warmup W] [--zero 0|1|2|3]
 *                         [--zero3-keep-grads 0|1] [--zero2-release-grads 0|1] [--freeze PREFIX]
 *                         [--find-unused 0|1]
 *
 * Trains the MLP of examples/common.h (784-256-128-10) data-parallel exactly as
 * examples/fmnist_dp.c does (this file includes it): global batch B (default 128) split
 * over the ranks, one compute thread per rank, SGD lr 0.1 momentum 0.9 (constant), the
 * distributed sampler, gradient buckets of 64 KiB averaged during backward. --world takes
 * a comma-separated list and runs each world size in turn in this process, so that the
 * ratios hold on a noisy machine; --repeat R runs the whole list R times and reports each
 * world size's best run (the least disturbed by other processes). --batches K stops each
 * epoch after K steps. --compress and --local-sgd set the engine's gradient compression and
 * local SGD (dtr_dp_config; see examples/fmnist_dp.c), --zero the ZeRO stage
 * (optimizer_state_bytes: rank 0's optimizer state, its shard with ZeRO; param_bytes_peak: the
 * most parameter bytes rank 0 held at once, its shard and the gathered units with ZeRO-3).
 *
 * Output: one JSON line per world size, then the speed-up of each against the first:
 *   {"bench":"fmnist_dp","impl":"dtrain","transport":"local","world":2,"global_batch":128,
 *    "epochs":1,"steps":469,"train_s":3.1,"samples_per_s":19300,"test_acc":0.83,"buckets":2,
 *    "overlapped_buckets":2,"best_of":1,
 *    "compress":"none","local_sgd":0,"bytes_per_step":940608,"f32_bytes_per_step":940608}
 *   {"bench":"fmnist_dp_speedup","transport":"local","world":2,"vs_world":1,"speedup":1.85}
 * train_s is the time of the training steps (slowest rank; no data loading or evaluation);
 * samples_per_s = samples trained over all ranks / train_s; bytes_per_step is the payload one
 * rank hands to the engine's collectives per step (dtr_dp_stats.wire_bytes / steps). Target: 2 ranks >= 1.6x 1 rank.
 *
 * --ceiling 1 (local transport) also runs, in every repeat, each world size above the first
 * without any synchronisation (local SGD that never averages: the same threads, batches and
 * compute, no communication), and prints what the machine allows beside what was reached:
 *   {"bench":"fmnist_dp_ceiling","world":2,"vs_world":1,"speedup_no_sync":1.9,"speedup":1.7,
 *    "efficiency":0.89}
 * (efficiency = speedup / speedup_no_sync). On a machine whose cores share their vector
 * units (virtual CPUs that are hyper-threads of one core), speedup_no_sync stays far below
 * the world size and no engine can reach the target; this line says so in the same run.
 * Data: --data, else $DTR_FMNIST_DIR, else /usr/share/datasets/fashion-mnist. */
#define FMNIST_DP_NO_MAIN
#include "../examples/fmnist_dp.c"

/* keeps the faster of *best and *res (samples per second; a run that is not ok never wins) */
static void dp_keep_best(dp_result *best, const dp_result *res) {
    if (res->ok && (!best->ok || res->samples / res->train_s > best->samples / best->train_s)) *best = *res;
}

/* o's world trained without any synchronisation (local SGD that never averages), the best
 * kept in *best: the compute the machine gives that many threads */
static int dp_free_run(const dp_opts *o, const dtr_mnist *data, dp_result *best) {
    dp_opts f = *o;
    dp_result res;
    f.zero = 0;
    f.compress = DTR_COMPRESS_NONE;
    f.local_sgd = 1 << 30;
    f.local_sgd_warmup = 0;
    if (!dp_train(&f, data, &res)) return 0;
    dp_keep_best(best, &res);
    return 1;
}

int main(int argc, char **argv) {
    dp_opts o = dp_opts_default();
    const char *worlds = "1,2", *p;
    int nw = 0, wl[16], rep, repeat = 1, ceiling = 0, i, k;
    dp_result best[16], free_run[16];
    dtr_mnist data;
    o.epochs = 1;
    o.cosine = 0;
    o.quiet = 1;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) { fprintf(stderr, "fmnist_dp: %s needs a value (see the top of bench/fmnist_dp.c)\n", a); return 2; }
        i++;
        if ((k = dp_parse_compress(&o, a, v)) != 0) { if (k < 0) return 2; continue; }
        if (!strcmp(a, "--world")) worlds = v;
        else if (!strcmp(a, "--transport")) o.transport = v;
        else if (!strcmp(a, "--provider")) o.provider = v;
        else if (!strcmp(a, "--epochs")) o.epochs = atoi(v);
        else if (!strcmp(a, "--batches")) o.max_steps = atol(v);
        else if (!strcmp(a, "--batch")) o.batch = atoi(v);
        else if (!strcmp(a, "--bucket")) o.bucket = (size_t)strtoull(v, NULL, 10);
        else if (!strcmp(a, "--data")) o.dir = v;
        else if (!strcmp(a, "--seed")) o.seed = strtoul(v, NULL, 10);
        else if (!strcmp(a, "--repeat")) repeat = atoi(v);
        else if (!strcmp(a, "--ceiling")) ceiling = atoi(v);
        else { fprintf(stderr, "fmnist_dp: unknown option %s\n", a); return 2; }
    }
    if (o.epochs < 1 || o.batch < 1 || o.max_steps < 0 || repeat < 1) {
        fprintf(stderr, "fmnist_dp: need --epochs >= 1, --batch >= 1, --batches >= 0, --repeat >= 1\n");
        return 2;
    }
    for (p = worlds; *p && nw < 16;) {
        char *end = NULL;
        wl[nw] = (int)strtol(p, &end, 10);
        if (end == p || wl[nw] < 1 || (*end && *end != ',')) { fprintf(stderr, "fmnist_dp: bad --world list '%s'\n", worlds); return 2; }
        nw++;
        p = *end == ',' ? end + 1 : end;
    }
    if (strcmp(o.transport, "local") != 0) {   /* a process job has one world size: the launcher's */
        dtr_rendezvous_config rc = dtr_rendezvous_config_init();
        char err[256];
        if (dtr_rendezvous_config_from_env(&rc, err, sizeof err) == DTR_OK) wl[0] = (int)rc.world_size;
        nw = 1;
        repeat = 1;
        ceiling = 0;
    }
    memset(best, 0, sizeof best);
    memset(free_run, 0, sizeof free_run);
    o.dir = fm_data_dir(o.dir);
    if (fm_data_load(o.dir, &data) != DTR_OK) return 1;
    for (rep = 0; rep < repeat; rep++)
        for (i = 0; i < nw; i++) {
            dp_result res;
            o.world = wl[i];
            if (!dp_train(&o, &data, &res)) { dtr_mnist_destroy(&data); return 1; }
            dp_keep_best(&best[i], &res);
            if (ceiling && i > 0 && !dp_free_run(&o, &data, &free_run[i])) { dtr_mnist_destroy(&data); return 1; }
        }
    for (i = 0; i < nw; i++) {
        double sps;
        if (!best[i].ok) continue;   /* not rank 0 of a multi-process job */
        sps = (double)best[i].samples / best[i].train_s;
        printf("{\"bench\":\"fmnist_dp\",\"impl\":\"dtrain\",\"transport\":\"%s\",\"provider\":\"%s\",\"world\":%d,\"global_batch\":%d,"
               "\"epochs\":%d,\"steps\":%lld,\"train_s\":%.3f,\"samples_per_s\":%.0f,\"test_acc\":%.4f,\"buckets\":%d,"
               "\"overlapped_buckets\":%d,\"best_of\":%d,\"compress\":\"%s\",\"local_sgd\":%d,\"bytes_per_step\":%.0f,"
               "\"f32_bytes_per_step\":%.0f,\"zero\":%d,\"zero3_keep_grads\":%d,\"zero2_release_grads\":%d,\"optimizer_state_bytes\":%zu,"
               "\"param_bytes_peak\":%llu,\"freeze\":\"%s\",\"find_unused\":%d}\n", o.transport,
               o.provider ? o.provider : strcmp(o.transport, "local") ? "auto" : "none", wl[i], o.batch, o.epochs, (long long)best[i].steps,
               best[i].train_s, sps, best[i].test_acc, best[i].buckets, best[i].overlapped, repeat,
               dp_compress_names[o.compress], o.local_sgd, (double)best[i].stats.wire_bytes / (double)best[i].steps,
               (double)best[i].stats.raw_bytes / (double)best[i].steps, o.zero, o.zero3_keep_grads, o.zero2_release_grads, best[i].opt_state_bytes,
               (unsigned long long)best[i].stats.param_bytes_peak, o.freeze ? o.freeze : "", o.find_unused);
        if (i > 0 && best[0].ok)
            printf("{\"bench\":\"fmnist_dp_speedup\",\"transport\":\"%s\",\"world\":%d,\"vs_world\":%d,\"speedup\":%.3f}\n",
                   o.transport, wl[i], wl[0], sps / ((double)best[0].samples / best[0].train_s));
        if (i > 0 && best[0].ok && free_run[i].ok) {
            double base = (double)best[0].samples / best[0].train_s;
            double top = (double)free_run[i].samples / free_run[i].train_s;
            printf("{\"bench\":\"fmnist_dp_ceiling\",\"world\":%d,\"vs_world\":%d,\"speedup_no_sync\":%.3f,\"speedup\":%.3f,"
                   "\"efficiency\":%.3f}\n", wl[i], wl[0], top / base, sps / base, sps / top);
        }
    }
    fflush(stdout);
    dtr_mnist_destroy(&data);
    return 0;
}
