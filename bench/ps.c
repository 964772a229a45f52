/* bench/ps.c: parameter servers (dtr_ps) against each other and against all-reduce data
 * parallelism, on the Fashion-MNIST MLP of examples/common.h.
 *
 *   build/bench/ps [--mode sync,async,ssp,dp] [--servers S] [--workers W] [--straggler-ms X]
 *                  [--straggler worker0|rotate] [--replicas 0|1] [--aggregate K] [--seed K]
 *                  [--backup-workers B]
 *                  [--epochs E] [--max-steps K] [--batch B] [--staleness s] [--bf16|--int8] [--repeat R]
 *                  [--data DIR]
 *
 * Each mode of the comma-separated list trains with examples/fmnist_ps.c (this file includes
 * it; ranks are threads of this process, one compute thread each) with S servers and W
 * workers, batch B per worker (default 64), Adam lr 1e-3 on the servers; "dp" is all-reduce
 * data parallelism (examples/fmnist_dp.c, also included) on W ranks with the same global
 * batch (W * B, SGD). --straggler-ms X slows worker 0 by X ms per step (--straggler rotate:
 * worker i's steps k with k mod W = i instead: about one slow worker at a time, a different
 * one each step; dp runs without stragglers). --replicas 1 gives each server a backup (2S server
 * ranks; the cost of replication). --aggregate K: async and SSP servers average K pushes per
 * update (sync ignores it); --backup-workers B: sync rounds go without the last B pushes
 * ("backup_workers" and "discarded", server 0's late pushes, in the output). The PS workers take
 * their batches from one counter (E epochs of the data, or W * K batches per epoch with
 * --max-steps K), so a fast worker trains more batches when the mode lets it; dp's ranks
 * take fixed shards (an all-reduce step needs every rank). --repeat R runs the
 * list R times and keeps each mode's best (the least disturbed by other processes).
 *
 * Output: one JSON line per mode:
 *   {"bench":"ps","mode":"ssp","servers":2,"replicas":0,"workers":4,"straggler_ms":20,
 *    "straggler":"worker0","aggregate":0,"push":"f32","batch_per_worker":64,"samples_per_s":..,
 *    "step_ms":..,"test_acc":..,"staleness":[..16 bins..],"max_staleness":2,"bytes_per_step":..,
 *    "refused":0,"backup_workers":0,"discarded":0,"best_of":3}
 * samples_per_s: samples of all workers over the slowest worker's training time; step_ms:
 * that time over worker 0's steps (the straggler's, when there is one); bytes_per_step: what worker 0 put on and took off the
 * wire per step (push + pull, headers included); staleness: server 0's histogram of pushes
 * by clocks of staleness (last bin: 15 or more). For dp, bytes_per_step is rank 0's
 * all-reduce payload (dtr_dp_stats.wire_bytes / steps).
 * Targets (docs/parameter-server.md): with one worker slowed 2x, async and SSP >= 1.5x the
 * samples/s of sync at equal accuracy (within 1 point); sync within 1.3x of dp's step time. */
#define FMNIST_PS_NO_MAIN
#define FMNIST_DP_NO_MAIN
#include "../examples/fmnist_ps.c"
#include "../examples/fmnist_dp.c"

typedef struct bench_row { int ok; double sps, step_ms, acc, bytes; ps_result ps; } bench_row;

static int run_dp(const ps_opts *po, const dtr_mnist *data, bench_row *row) {
    dp_opts o = dp_opts_default();
    dp_result res;
    o.world = po->world - po->servers * (1 + po->replicas), o.epochs = po->epochs, o.batch = po->batch * o.world;
    o.max_steps = po->max_steps, o.quiet = 1, o.cosine = 0;
    if (!dp_train(&o, data, &res) || !res.ok) return 0;
    row->ok = 1;
    row->sps = (double)res.samples / res.train_s;
    row->step_ms = 1000.0 * res.train_s / (double)res.steps;
    row->acc = res.test_acc;
    row->bytes = (double)res.stats.wire_bytes / (double)res.steps;
    return 1;
}

static int run_ps(const ps_opts *po, const dtr_mnist *data, bench_row *row) {
    static int64_t claim;
    ps_opts o = *po;
    ps_result res;
    claim = 0;
    o.claim = &claim;   /* fast workers take more batches (threads share one counter) */
    if (!ps_train(&o, data, &res) || !res.ok || res.train_s <= 0) return 0;
    row->ok = 1;
    row->ps = res;
    row->sps = (double)res.samples / res.train_s;
    row->step_ms = 1000.0 * res.train_s / (double)(res.worker.pushes ? res.worker.pushes : 1);
    row->acc = res.test_acc;
    row->bytes = (double)(res.worker.bytes_sent + res.worker.bytes_received) / (double)(res.worker.pushes ? res.worker.pushes : 1);
    return 1;
}

static void print_row(const ps_opts *o, const char *mode, const bench_row *r, int repeat) {
    int i;
    printf("{\"bench\":\"ps\",\"mode\":\"%s\",\"servers\":%d,\"replicas\":%d,\"workers\":%d,\"straggler_ms\":%d,"
           "\"straggler\":\"%s\",\"aggregate\":%d,\"push\":\"%s\",\"batch_per_worker\":%d,"
           "\"samples_per_s\":%.0f,\"step_ms\":%.2f,\"test_acc\":%.4f,\"bytes_per_step\":%.0f,\"staleness\":[", mode,
           strcmp(mode, "dp") ? o->servers : 0, strcmp(mode, "dp") ? o->replicas : 0, o->world - o->servers * (1 + o->replicas),
           strcmp(mode, "dp") ? o->straggler_ms : 0, o->straggler_rotate ? "rotate" : "worker0",
           strcmp(mode, "sync") && strcmp(mode, "dp") ? o->aggregate : 0,
           !strcmp(mode, "dp") ? "f32" : o->int8 ? "int8" : o->bf16 ? "bf16" : "f32", o->batch, r->sps, r->step_ms,
           r->acc, r->bytes);
    for (i = 0; i < DTR_PS_STALENESS_BINS; i++) printf("%s%lld", i ? "," : "", (long long)r->ps.server.staleness[i]);
    printf("],\"max_staleness\":%lld,\"refused\":%lld,\"backup_workers\":%d,\"discarded\":%lld,\"best_of\":%d}\n",
           (long long)r->ps.server.max_staleness, (long long)r->ps.server.refused, strcmp(mode, "sync") ? 0 : o->backup,
           (long long)r->ps.server.stale_discarded, repeat);
    fflush(stdout);
}

int main(int argc, char **argv) {
    ps_opts o = ps_opts_default();
    const char *modes = "sync,async,ssp,dp";
    char *args[64], list[64], *tok, *save = NULL;
    int n = 0, i, repeat = 1, rep, k, nm = 0;
    const char *names[8];
    bench_row best[8];
    dtr_mnist data;
    (void)dp_parse_compress;
    o.epochs = 1, o.quiet = 1;
    for (i = 0; i < argc && n < 64; i++) {   /* the bench's own options; the rest go to ps_parse */
        if (i + 1 < argc && !strcmp(argv[i], "--mode")) modes = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--repeat")) repeat = atoi(argv[++i]);
        else args[n++] = argv[i];
    }
    o.world = 6;
    if (!ps_parse(&o, n, args) || repeat < 1) return 2;
    snprintf(list, sizeof list, "%s", modes);
    for (tok = strtok_r(list, ",", &save); tok && nm < 8; tok = strtok_r(NULL, ",", &save)) names[nm++] = tok;
    memset(best, 0, sizeof best);
    if (fm_data_load(fm_data_dir(o.dir), &data) != DTR_OK) return 1;
    for (rep = 0; rep < repeat; rep++)
        for (k = 0; k < nm; k++) {
            bench_row row;
            memset(&row, 0, sizeof row);
            o.mode = !strcmp(names[k], "async") ? DTR_PS_ASYNC : !strcmp(names[k], "ssp") ? DTR_PS_SSP : DTR_PS_SYNC;
            if (!(strcmp(names[k], "dp") ? run_ps(&o, &data, &row) : run_dp(&o, &data, &row))) { dtr_mnist_destroy(&data); return 1; }
            if (!best[k].ok || row.sps > best[k].sps) best[k] = row;
        }
    for (k = 0; k < nm; k++) print_row(&o, names[k], &best[k], repeat);
    dtr_mnist_destroy(&data);
    return 0;
}
