/* ============================================================================
 * The watchdog of a process transport (libfabric now, NCCL next): a thread that turns a
 * dead or silent peer into a failure of the whole world, and spreads failures through the
 * rendezvous store, using the bootstrap's store connection, namespace, hosts and pids.
 *   every tick (50 ms)   peers on this host: dead when their pid is gone or a zombie;
 *                        our own failure: written to the world's abort key
 *   every 5 ticks        the abort key (another rank's failure), our heartbeat, and one
 *                        remote peer's heartbeat (dead after stale_ns without a change)
 * A peer that wrote its "left" key closed cleanly: the transport is told (ops.left) instead
 * of a failure. Failures go to the transport through ops.fail; the transport says through
 * ops.to_publish whether it failed on its own and the world must hear of it. Part of
 * dtrain_comm.c (POSIX process APIs).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_rdzv.h"
#include "../public/api_comm.h"
#include "../core/internal.h"
#include "comm_internal.h"

#if !defined(_WIN32)
#include <sys/types.h>

#define DTR__WATCH_TICK_MS 50

dtr_result dtr__watchdog_publish(dtr__watchdog *w, int who, const char *why) {
    char key[96], val[256];
    dtr_result r;
    snprintf(val, sizeof val, "%d %s", who, why);
    dtr__boot_key(w->boot, key, sizeof key, "abort", -1);
    r = dtr_store_set(w->boot->st, key, val, strlen(val));
    if (r == DTR_OK) w->published = 1;
    return r;
}

/* A peer looks dead: unless it left cleanly, break the world naming it. */
static void dtr__watch_peer_gone(dtr__watchdog *w, int p, const char *how) {
    char key[96], v[8];
    size_t len;
    int found = 0;
    dtr__boot_key(w->boot, key, sizeof key, "left", p);
    if (dtr_store_check(w->boot->st, key, v, sizeof v, &len, &found) == DTR_OK && found) {
        w->gone[p] = 1;
        w->ops.left(w->ops.t, p);
        return;
    }
    /* tell the world first, without the transport's lock: a thread of ours may be stuck
       inside the transport holding it, and the other ranks must learn of the death */
    if (!w->published) dtr__watchdog_publish(w, p, how);
    w->ops.fail(w->ops.t, p, how, !w->published);
}

/* Our own failure, not yet told: write it to the abort key. 1 when the store is gone. */
static int dtr__watch_own_failure(dtr__watchdog *w) {
    char why[256];
    int who = -1;
    if (w->published) return 0;
    if (w->ops.to_publish(w->ops.t, &who, why, sizeof why) && dtr__watchdog_publish(w, who, why) != DTR_OK) {
        w->published = 1;
        return 1;
    }
    w->published = 1;
    return 0;
}

static void dtr__watch_local_peers(dtr__watchdog *w) {
    const dtr__boot *b = w->boot;
    int p;
    for (p = 0; p < b->size; p++)
        if (p != b->rank && b->on_host[p] && !w->gone[p] && dtr__pid_dead(b->pids[p])) {
            char how[160];
            snprintf(how, sizeof how, "rank %d (pid %d on this host) died", p, b->pids[p]);
            dtr__watch_peer_gone(w, p, how);
        }
}

/* One remote peer's heartbeat per call, round robin. */
static dtr_result dtr__watch_remote_peer(dtr__watchdog *w) {
    const dtr__boot *b = w->boot;
    char key[96], val[64];
    size_t len = 0;
    int found = 0, p, k;
    dtr_result r;
    int64_t now = dtr_time_ns(), v;
    for (k = 0, p = -1; k < b->size && p < 0; k++) {
        int q = (w->next_remote + k) % b->size;
        if (q != b->rank && !b->on_host[q] && !w->gone[q]) p = q;
    }
    if (p < 0) return DTR_OK;
    w->next_remote = (p + 1) % b->size;
    dtr__boot_key(w->boot, key, sizeof key, "beat", p);
    if ((r = dtr_store_check(b->st, key, val, sizeof val - 1, &len, &found)) != DTR_OK) return r;
    val[len < sizeof val ? len : sizeof val - 1] = 0;
    v = found ? strtoll(val, NULL, 10) : 0;
    if (v != w->beat[p] || !w->beat_ns[p]) { w->beat[p] = v; w->beat_ns[p] = now; }
    else if (now - w->beat_ns[p] > w->stale_ns) {
        char how[160];
        snprintf(how, sizeof how, "rank %d stopped answering (no heartbeat for %lld ms)", p,
                 (long long)((now - w->beat_ns[p]) / 1000000));
        dtr__watch_peer_gone(w, p, how);
    }
    return DTR_OK;
}

/* Every 250 ms: the world's abort key, our heartbeat, a remote peer's. DTR_OK, or the error
 * of a store that is gone. Sets *aborted when another rank broke the world. */
static dtr_result dtr__watch_world(dtr__watchdog *w, int *aborted) {
    char key[96], val[256];
    size_t len = 0;
    int found = 0;
    dtr_result r;
    dtr__boot_key(w->boot, key, sizeof key, "abort", -1);
    r = dtr_store_check(w->boot->st, key, val, sizeof val - 1, &len, &found);
    if (r == DTR_OK && found) {
        int who = -1, off = 0;
        val[len < sizeof val ? len : sizeof val - 1] = 0;
        if (sscanf(val, "%d %n", &who, &off) < 1) off = 0;
        w->ops.fail(w->ops.t, who, val + off, 0);
        w->published = 1;
        *aborted = 1;
        return DTR_OK;
    }
    if (r == DTR_OK) {
        dtr__boot_key(w->boot, key, sizeof key, "beat", w->boot->rank);
        r = dtr_store_add(w->boot->st, key, 1, NULL);
    }
    if (r == DTR_OK && w->boot->local_size < w->boot->size) r = dtr__watch_remote_peer(w);
    return r;
}

static void *dtr__watch_main(void *arg) {
    dtr__watchdog *w = (dtr__watchdog *)arg;
    int tick = 0, store_dead = 0;
    for (;;) {
        int stop, aborted = 0;
        pthread_mutex_lock(&w->mu);
        if (!w->stop) dtr__cond_wait_until(&w->cv, &w->mu, dtr_time_ns() + (int64_t)DTR__WATCH_TICK_MS * 1000000);
        stop = w->stop;
        pthread_mutex_unlock(&w->mu);
        if (stop) break;
        tick++;
        if (store_dead || w->published) continue;
        if (w->ops.failed(w->ops.t)) { store_dead = dtr__watch_own_failure(w); continue; }
        dtr__watch_local_peers(w);
        if (tick % 5 || w->ops.failed(w->ops.t)) continue;
        if (dtr__watch_world(w, &aborted) != DTR_OK && !aborted) {
            /* the store (rank 0's server) is gone: rank 0 died or the network to it did */
            char why[256];
            snprintf(why, sizeof why, "the rendezvous store (hosted by rank 0) is unreachable: %.150s",
                     dtr_store_last_error(w->boot->st));
            w->ops.fail(w->ops.t, 0, why, 0);
            store_dead = 1;
        }
    }
    return NULL;
}

dtr_result dtr__watchdog_start(dtr__watchdog *w, dtr__boot *b, const dtr__watch_ops *ops) {
    int64_t stale_ms = b->timeout_ms / 2 < 30000 ? b->timeout_ms / 2 : 30000;
    memset(w, 0, sizeof *w);
    w->boot = b;
    w->ops = *ops;
    w->stale_ns = (stale_ms < 2000 ? 2000 : stale_ms) * (int64_t)1000000;
    w->gone = (int *)dtr__calloc(&b->alloc, sizeof(int) * (size_t)b->size);
    w->beat = (int64_t *)dtr__calloc(&b->alloc, sizeof(int64_t) * (size_t)b->size);
    w->beat_ns = (int64_t *)dtr__calloc(&b->alloc, sizeof(int64_t) * (size_t)b->size);
    pthread_mutex_init(&w->mu, NULL);
    dtr__cond_init(&w->cv);
    w->inited = 1;
    if (!w->gone || !w->beat || !w->beat_ns) return DTR_OUT_OF_MEMORY;
    /* short store deadlines from now on, so a dead server is noticed */
    dtr__store_set_timeout(b->st, b->timeout_ms < 10000 ? b->timeout_ms : 10000);
    if (pthread_create(&w->thread, NULL, dtr__watch_main, w) != 0) return DTR_OUT_OF_MEMORY;
    w->on = 1;
    return DTR_OK;
}

void dtr__watchdog_wake(dtr__watchdog *w) {
    if (!w->inited) return;
    pthread_mutex_lock(&w->mu);
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void dtr__watchdog_stop(dtr__watchdog *w) {
    if (!w->inited) return;
    if (w->on) {
        pthread_mutex_lock(&w->mu);
        w->stop = 1;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL);
        w->on = 0;
    }
    /* a failure the thread had no time to tell (abort, then destroy at once) */
    if (w->boot->st && w->ops.failed(w->ops.t)) dtr__watch_own_failure(w);
    /* left cleanly: the peers' watchdogs must not take our exit for a death */
    if (w->boot->st) {
        char key[96];
        dtr__boot_key(w->boot, key, sizeof key, "left", w->boot->rank);
        dtr_store_set(w->boot->st, key, "1", 1);
    }
}

void dtr__watchdog_free(dtr__watchdog *w) {
    if (!w->inited) return;
    dtr__free(&w->boot->alloc, w->gone);
    dtr__free(&w->boot->alloc, w->beat);
    dtr__free(&w->boot->alloc, w->beat_ns);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    w->inited = 0;
}

#endif /* !_WIN32 */
