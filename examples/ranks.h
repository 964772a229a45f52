/* examples/ranks.h: runs one function on every rank of a process group, the same way for
 * every distributed example:
 *   - transport "local": `world` threads of this process, one rank each (dtr_local_world);
 *   - another transport (e.g. "libfabric", from dtrain_comm.c): this process is one rank of a
 *     job started by a launcher (`dtrun -n 2 -- prog --transport libfabric`; torchrun, Slurm
 *     and Open MPI variables work too), joined through the rendezvous store.
 * The function gets the group and returns 1 on success; ex_run_ranks returns 1 when every
 * rank of this process succeeded. Include after dtrain.h (and common.h, which asks for
 * POSIX). Everything is static. */
#ifndef DTRAIN_EXAMPLES_RANKS_H
#define DTRAIN_EXAMPLES_RANKS_H
#include <pthread.h>
#include <stdio.h>
#include <string.h>

typedef int (*ex_rank_fn)(dtr_comm *c, void *user);

/* set before ex_run_ranks: the groups it makes isolate peer failures (a dead rank fails only
   the operations with it: dtr_comm_config.isolate_peer_failures) */
static int ex_isolate_peer_failures;

typedef struct ex_thread {
    ex_rank_fn fn;
    void *user;
    dtr_local_world *w;
    int rank, ok;
} ex_thread;

static void *ex_thread_main(void *p) {
    ex_thread *t = (ex_thread *)p;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    char err[256];
    dtr_result r;
    cfg.local.world = t->w;
    cfg.local.rank = t->rank;
    cfg.isolate_peer_failures = ex_isolate_peer_failures;
    if ((r = dtr_comm_create(&cfg, &c, err, sizeof err)) != DTR_OK) {
        fprintf(stderr, "rank %d: error: dtr_comm_create: %s (%s)\n", t->rank, dtr_result_string(r), err);
        return NULL;
    }
    t->ok = t->fn(c, t->user);
    dtr_comm_destroy(c);
    return NULL;
}

static int ex_run_threads(int world, ex_rank_fn fn, void *user) {
    pthread_t tid[64];
    ex_thread t[64];
    dtr_local_world *w = NULL;
    int i, ok = 1;
    if (world < 1 || world > 64 || dtr_local_world_create(world, NULL, &w) != DTR_OK) {
        fprintf(stderr, "error: --world must be 1 to 64\n");
        return 0;
    }
    for (i = 0; i < world; i++) {
        t[i].fn = fn, t[i].user = user, t[i].w = w, t[i].rank = i, t[i].ok = 0;
        if (pthread_create(&tid[i], NULL, ex_thread_main, &t[i]) != 0) {
            fprintf(stderr, "error: cannot start rank thread %d\n", i);
            world = i;
            ok = 0;
            break;
        }
    }
    for (i = 0; i < world; i++) { pthread_join(tid[i], NULL); ok &= t[i].ok; }
    dtr_local_world_destroy(w);
    return ok;
}

/* this process as its rank of a launcher's job; verbose: rank 0 names the provider */
static int ex_run_process(const char *prog, const char *transport, const char *provider, int verbose, ex_rank_fn fn,
                          void *user) {
    dtr_rendezvous_config rc = dtr_rendezvous_config_init();
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_store *st = NULL;
    dtr_comm *c = NULL;
    char err[512];
    int ok = 0;
    if (dtr_rendezvous_config_from_env(&rc, err, sizeof err) != DTR_OK) {
        fprintf(stderr, "error: --transport %s runs one process per rank under the launcher: "
                "dtrun -n 2 -- %s ... --transport %s (%s)\n", transport, prog, transport, err);
        return 0;
    }
    if (dtr_store_create(&rc, &st, err, sizeof err) != DTR_OK) {
        fprintf(stderr, "rank %d: error: joining the rendezvous store at %s:%d failed: %s\n", (int)rc.rank,
                rc.master_addr, rc.port, err);
        return 0;
    }
    cfg.transport = transport;
    cfg.fabric.provider = provider;
    cfg.store = st;
    cfg.isolate_peer_failures = ex_isolate_peer_failures;
    if (dtr_comm_create(&cfg, &c, err, sizeof err) != DTR_OK) {
        fprintf(stderr, "error: %s\n", err);
    } else {
        if (rc.rank == 0 && verbose && dtr_comm_transport_detail(c)[0])   /* what it picked */
            printf("%s: %s provider: %s%s\n", prog, transport, dtr_comm_transport_detail(c),
                   provider && *provider ? "" : " (chosen automatically)");
        ok = fn(c, user);
        dtr_comm_destroy(c);
    }
    dtr_store_destroy(st);
    return ok;
}

/* Runs fn on `world` thread ranks (transport "local") or as this process's rank. */
static int ex_run_ranks(const char *prog, const char *transport, const char *provider, int world, int verbose,
                        ex_rank_fn fn, void *user) {
    if (strcmp(transport, "local") == 0) return ex_run_threads(world, fn, user);
    return ex_run_process(prog, transport, provider, verbose, fn, user);
}
#endif
