/* ============================================================================
 * The bootstrap of a transport whose ranks are processes (libfabric now, NCCL next): through
 * the rendezvous store it gets rank and size, its own store connection (so its exchanges and
 * its watchdog never queue behind the application's store calls), a namespace for this open
 * ("<prefix>/<n>": the n-th opens of all ranks meet there), every rank's host identity and
 * pid (hence local rank and size, and which peers can be watched by pid), and a place to
 * publish and fetch per-rank values (endpoint addresses, unique ids). An exchange that times
 * out names the rank it was waiting for. Part of dtrain_comm.c (POSIX process APIs).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_rdzv.h"
#include "../public/api_comm.h"
#include "../core/internal.h"
#include "comm_internal.h"

#if !defined(_WIN32)
#include <unistd.h>

/* "<boot id>|<pid namespace>": equal for two processes exactly when they share a kernel and
 * can see each other's pids. */
static void dtr__boot_host_id(char *out, size_t cap, int rank) {
    char boot[64] = "", ns[64] = "";
    FILE *fp = fopen("/proc/sys/kernel/random/boot_id", "r");
    ssize_t n;
    if (fp) {
        if (!fgets(boot, sizeof boot, fp)) boot[0] = 0;
        fclose(fp);
        boot[strcspn(boot, "\n")] = 0;
    }
    n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    ns[n > 0 ? n : 0] = 0;
    if (!boot[0] && gethostname(boot, sizeof boot - 1) != 0) boot[0] = 0;
    boot[sizeof boot - 1] = 0;
    if (dtr__fake_ranks_per_host() > 0) /* fake hosts of k consecutive ranks ($DTR_RANKS_PER_HOST) */
        snprintf(out, cap, "%s|%s|fake%d", boot, ns, rank / dtr__fake_ranks_per_host());
    else
        snprintf(out, cap, "%s|%s", boot, ns);
}

void dtr__boot_key(const dtr__boot *b, char *key, size_t cap, const char *what, int rank) {
    if (rank >= 0) snprintf(key, cap, "%s/%s/%d", b->ns, what, rank);
    else snprintf(key, cap, "%s/%s", b->ns, what);
}

dtr_result dtr__boot_fail(const dtr__boot *b, dtr_result r, const char *what, char *err, size_t errlen) {
    if (r == DTR_TIMEOUT && b->waiting_for >= 0)
        return dtr__errf(err, errlen, r, "%s rank %d: rank %d did not open the %s group within %d ms (did it start, join "
                         "the store with the same secret, and call dtr_comm_create?): %s", b->transport, b->rank,
                         b->waiting_for, b->transport, b->timeout_ms, dtr_store_last_error(b->st));
    return dtr__errf(err, errlen, r, "%s rank %d: %s: %s", b->transport, b->rank, what,
                     b->st ? dtr_store_last_error(b->st) : "no store");
}

dtr_result dtr__boot_publish(dtr__boot *b, const char *what, const void *data, size_t len) {
    char key[128];
    dtr__boot_key(b, key, sizeof key, what, b->rank);
    return dtr_store_set(b->st, key, data, len);
}

dtr_result dtr__boot_fetch(dtr__boot *b, const char *what, int rank, void *buf, size_t cap, size_t *len) {
    char key[128];
    dtr__boot_key(b, key, sizeof key, what, rank);
    b->waiting_for = rank;
    return dtr_store_get(b->st, key, buf, cap, len);
}

/* cfg->store, or one made from the environment (dtrun, torchrun, Slurm, ...). */
static dtr_result dtr__boot_store(dtr__boot *b, const dtr_comm_config *cfg, dtr_store **app, char *err, size_t errlen) {
    dtr_rendezvous_config rc = dtr_rendezvous_config_init();
    char e2[400];
    dtr_result r;
    *app = cfg->store;
    if (*app) return DTR_OK;
    rc.alloc = cfg->alloc;
    if (dtr_rendezvous_config_from_env(&rc, e2, sizeof e2) != DTR_OK)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: no rendezvous store in the config, and none from the "
                         "environment: %s (start the ranks with dtrun, or set cfg.store)", b->transport, e2);
    if (cfg->timeout_ms > 0) rc.timeout_ms = cfg->timeout_ms;   /* one deadline: the group's, else DTR_TIMEOUT_MS */
    if ((r = dtr_store_create(&rc, &b->app_store, e2, sizeof e2)) != DTR_OK)
        return dtr__errf(err, errlen, r, "%s: joining the rendezvous store of the environment (%s:%d) failed: %s",
                         b->transport, rc.master_addr, rc.port, e2);
    *app = b->app_store;
    return DTR_OK;
}

/* Every rank's "<pid> <host id>": on_host, pids, local rank and size. */
static dtr_result dtr__boot_hosts(dtr__boot *b, char *err, size_t errlen) {
    char host[200], buf[240];
    dtr_result r;
    int i;
    dtr__boot_host_id(host, sizeof host, b->rank);
    snprintf(buf, sizeof buf, "%d %s", (int)getpid(), host);
    if ((r = dtr__boot_publish(b, "host", buf, strlen(buf))) != DTR_OK) return dtr__boot_fail(b, r, "publishing the host", err, errlen);
    for (i = 0; i < b->size; i++) {
        size_t len = 0;
        int off = 0;
        if ((r = dtr__boot_fetch(b, "host", i, buf, sizeof buf - 1, &len)) != DTR_OK)
            return dtr__boot_fail(b, r, "reading the hosts", err, errlen);
        buf[len < sizeof buf ? len : sizeof buf - 1] = 0;
        if (sscanf(buf, "%d %n", &b->pids[i], &off) < 1) off = (int)len;
        b->on_host[i] = !strcmp(buf + off, host);
        if (b->on_host[i] && i < b->rank) b->local_rank++;
        b->local_size += b->on_host[i];
    }
    b->waiting_for = -1;
    return DTR_OK;
}

dtr_result dtr__boot_open(dtr__boot *b, const dtr_comm_config *cfg, const char *transport, const char *prefix, char *err,
                          size_t errlen) {
    dtr_store *app;
    dtr_result r;
    char key[96];
    int64_t gen = 0;
    memset(b, 0, sizeof *b);
    b->alloc = cfg->alloc;
    b->transport = transport;
    b->waiting_for = -1;
    b->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : dtr__default_timeout_ms();   /* DTR_TIMEOUT_MS */
    if ((r = dtr__boot_store(b, cfg, &app, err, errlen)) != DTR_OK) return r;
    b->app = app;
    b->rank = dtr_store_rank(app);
    b->size = dtr_store_world_size(app);
    if ((r = dtr__store_clone(app, b->timeout_ms, &b->st, err, errlen)) != DTR_OK) return r;
    b->on_host = (int *)dtr__calloc(&b->alloc, sizeof(int) * (size_t)b->size);
    b->pids = (int *)dtr__calloc(&b->alloc, sizeof(int) * (size_t)b->size);
    if (!b->on_host || !b->pids) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", transport);
    snprintf(key, sizeof key, "%s/open/%d", prefix, b->rank);
    if ((r = dtr_store_add(b->st, key, 1, &gen)) != DTR_OK) return dtr__boot_fail(b, r, "numbering this open", err, errlen);
    snprintf(b->ns, sizeof b->ns, "%s/%lld", prefix, (long long)gen);
    return dtr__boot_hosts(b, err, errlen);
}

void dtr__boot_close(dtr__boot *b) {
    if (b->failed) {   /* a failed group: rank 0's store waits only the grace for the others to leave
                          (the stores this bootstrap owns; the application's may be gone already) */
        dtr_store_mark_failed(b->app_store);
        dtr_store_mark_failed(b->st);
    }
    if (b->st) dtr_store_destroy(b->st);
    if (b->app_store) dtr_store_destroy(b->app_store);
    dtr__free(&b->alloc, b->on_host);
    dtr__free(&b->alloc, b->pids);
    memset(b, 0, sizeof *b);
}

#endif /* !_WIN32 */
