/* bench/allreduce.c: all-reduce bandwidth of dtrain's process groups.
 *
 *   build/bench/allreduce [--transport local|NAME] [--provider P] [--world N]
 *                         [--algo auto|ring|rd] [--min BYTES] [--max BYTES] [--iters K]
 *
 * Prints one JSON line per message size, from --min (4 KiB) to --max (64 MiB), doubling:
 *   {"bench":"allreduce","impl":"dtrain","transport":"local","provider":"none","world":2,
 *    "algo":"auto","bytes":4096,"us":12.3,"algbw_gbps":0.33,"busbw_gbps":0.33}
 * us is the mean time of one in-place f32 sum all-reduce, measured on rank 0 over K calls
 * (default: about 256 MiB of traffic, between 5 and 1000 calls) after 2 warm-up calls;
 * algbw = bytes / us, busbw = algbw * 2(N-1)/N (the bytes each rank's link carries in a
 * bandwidth-optimal all-reduce, as nccl-tests report it).
 *
 * Transports:
 *   local      N ranks as threads of this process (--world N, default 2).
 *   otherwise  one process per rank, started by the launcher (dtrun), which sets the
 *              rendezvous environment (rank, world size, master address, DTR_SECRET); the
 *              transport (e.g. libfabric from dtrain_comm.c) must be linked in. --world is
 *              then only checked against the launcher's world size.
 * Every rank runs the same measurement loop (run_rank), whatever the transport. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "dtrain.h"

typedef struct opts {
    const char *transport, *provider;
    int world, iters;
    dtr_allreduce_algo algo;
    size_t min_bytes, max_bytes;
} opts;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The measurement, run by every rank of a group. Rank 0 prints. Returns 0 on success. */
static int run_rank(dtr_comm *c, const opts *o) {
    int N = dtr_comm_size(c), rank = dtr_comm_rank(c), k;
    size_t bytes, i, maxn = o->max_bytes / sizeof(float);
    float *buf = (float *)malloc(maxn * sizeof(float));
    dtr_result r = DTR_OK;
    if (!buf) return 1;
    for (bytes = o->min_bytes; bytes <= o->max_bytes && r == DTR_OK; bytes *= 2) {
        size_t n = bytes / sizeof(float);
        size_t budget = ((size_t)256 << 20) / bytes;   /* about 256 MiB of traffic per size */
        int iters = o->iters > 0 ? o->iters : budget < 5 ? 5 : budget > 1000 ? 1000 : (int)budget;
        double t0, us, algbw;
        for (i = 0; i < n; i++) buf[i] = 1.0f;
        for (k = 0; k < 2 && r == DTR_OK; k++) r = dtr_comm_all_reduce(c, buf, buf, n, DTR_F32, DTR_REDUCE_SUM);
        if (r == DTR_OK) r = dtr_comm_barrier(c);
        t0 = now_s();
        for (k = 0; k < iters && r == DTR_OK; k++) r = dtr_comm_all_reduce(c, buf, buf, n, DTR_F32, DTR_REDUCE_SUM);
        us = (now_s() - t0) * 1e6 / iters;
        if (r != DTR_OK) break;
        algbw = (double)bytes / us * 1e-3;
        if (rank == 0) {
            printf("{\"bench\":\"allreduce\",\"impl\":\"dtrain\",\"transport\":\"%s\",\"provider\":\"%s\",\"world\":%d,"
                   "\"algo\":\"%s\",\"bytes\":%zu,\"us\":%.2f,\"algbw_gbps\":%.3f,\"busbw_gbps\":%.3f}\n",
                   dtr_comm_transport_name(c), o->provider ? o->provider : "none", N, dtr_allreduce_algo_name(o->algo),
                   bytes, us, algbw, algbw * 2.0 * (N - 1) / N);
            fflush(stdout);
        }
    }
    if (r != DTR_OK) fprintf(stderr, "allreduce: rank %d: %s: %s\n", rank, dtr_result_string(r), dtr_comm_last_error(c));
    free(buf);
    return r == DTR_OK ? 0 : 1;
}

/* ---- local transport: ranks are threads ---- */

typedef struct rank_arg {
    const opts *o;
    dtr_local_world *w;
    int rank, rc;
} rank_arg;

static void *local_rank(void *p) {
    rank_arg *a = (rank_arg *)p;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    char err[256];
    dtr_result r;
    cfg.local.world = a->w;
    cfg.local.rank = a->rank;
    cfg.allreduce_algo = a->o->algo;
    r = dtr_comm_create(&cfg, &c, err, sizeof err);
    if (r != DTR_OK) {
        fprintf(stderr, "allreduce: rank %d: %s (%s)\n", a->rank, dtr_result_string(r), err);
        a->rc = 1;
        return NULL;
    }
    a->rc = run_rank(c, a->o);
    dtr_comm_destroy(c);
    return NULL;
}

static int run_local(const opts *o) {
    pthread_t *tid = (pthread_t *)calloc((size_t)o->world, sizeof(pthread_t));
    rank_arg *args = (rank_arg *)calloc((size_t)o->world, sizeof(rank_arg));
    dtr_local_world *w = NULL;
    int i, rc = 0;
    if (!tid || !args || dtr_local_world_create(o->world, NULL, &w) != DTR_OK) {
        fprintf(stderr, "allreduce: cannot make a local world of %d ranks\n", o->world);
        return 1;
    }
    for (i = 0; i < o->world; i++) {
        args[i].o = o;
        args[i].w = w;
        args[i].rank = i;
        pthread_create(&tid[i], NULL, local_rank, &args[i]);
    }
    for (i = 0; i < o->world; i++) {
        pthread_join(tid[i], NULL);
        rc |= args[i].rc;
    }
    dtr_local_world_destroy(w);
    free(tid);
    free(args);
    return rc;
}

/* ---- other transports: this process is one rank, found through the launcher ---- */

static int run_process(const opts *o) {
    dtr_rendezvous_config rc = dtr_rendezvous_config_init();
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_store *st = NULL;
    dtr_comm *c = NULL;
    char err[512];
    int status = 1;
    if (dtr_rendezvous_config_from_env(&rc, err, sizeof err) != DTR_OK ||
        dtr_store_create(&rc, &st, err, sizeof err) != DTR_OK) {
        fprintf(stderr, "allreduce: --transport %s runs one process per rank under the launcher (dtrun): %s\n",
                o->transport, err);
        return 1;
    }
    if (o->world > 0 && o->world != rc.world_size)
        fprintf(stderr, "allreduce: --world %d ignored: the launcher started %d ranks\n", o->world, (int)rc.world_size);
    cfg.transport = o->transport;
    cfg.fabric.provider = o->provider;
    cfg.store = st;
    cfg.allreduce_algo = o->algo;
    if (dtr_comm_create(&cfg, &c, err, sizeof err) != DTR_OK) {
        fprintf(stderr, "allreduce: rank %d: %s\n", (int)rc.rank, err);
    } else {
        status = run_rank(c, o);
        dtr_comm_destroy(c);
    }
    dtr_store_destroy(st);
    return status;
}

int main(int argc, char **argv) {
    opts o;
    int i;
    memset(&o, 0, sizeof o);
    o.transport = "local";
    o.world = 0;   /* local: 2 */
    o.min_bytes = (size_t)4 << 10;
    o.max_bytes = (size_t)64 << 20;
    o.algo = DTR_ALLREDUCE_AUTO;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) { fprintf(stderr, "allreduce: %s needs a value (see the top of bench/allreduce.c)\n", a); return 2; }
        i++;
        if (!strcmp(a, "--transport")) o.transport = v;
        else if (!strcmp(a, "--provider")) o.provider = v;
        else if (!strcmp(a, "--world")) o.world = atoi(v);
        else if (!strcmp(a, "--iters")) o.iters = atoi(v);
        else if (!strcmp(a, "--min")) o.min_bytes = (size_t)strtoull(v, NULL, 10);
        else if (!strcmp(a, "--max")) o.max_bytes = (size_t)strtoull(v, NULL, 10);
        else if (!strcmp(a, "--algo")) {
            if (!strcmp(v, "auto")) o.algo = DTR_ALLREDUCE_AUTO;
            else if (!strcmp(v, "ring")) o.algo = DTR_ALLREDUCE_RING;
            else if (!strcmp(v, "rd") || !strcmp(v, "recursive_doubling")) o.algo = DTR_ALLREDUCE_RECURSIVE_DOUBLING;
            else { fprintf(stderr, "allreduce: --algo is auto, ring or rd\n"); return 2; }
        } else { fprintf(stderr, "allreduce: unknown option %s\n", a); return 2; }
    }
    if (o.world == 0 && strcmp(o.transport, "local") == 0) o.world = 2;
    if (o.world < 0 || o.min_bytes < sizeof(float) || o.max_bytes < o.min_bytes) {
        fprintf(stderr, "allreduce: need --world >= 1 and 4 <= --min <= --max\n");
        return 2;
    }
    return strcmp(o.transport, "local") == 0 ? run_local(&o) : run_process(&o);
}
