/* ============================================================================
 * The watchdog of a process transport (libfabric now, NCCL next): a thread that turns a
 * dead or silent peer into a failure of the whole world, and spreads failures through the
 * rendezvous store, using the bootstrap's store connection, namespace, hosts and pids.
 *   every tick (50 ms)   peers on this host: dead when their pid is gone or a zombie;
 *                        our own failure: written to the world's abort key (first told wins);
 *                        the transport's own health (ops.check)
 *   every 2 ticks        the abort key (another rank's failure), our heartbeat, and the
 *                        peers' heartbeats (all of them up to 64 ranks, else one per round);
 *                        a remote peer is dead after stale_ns without a change
 * At a deadline (dtr__watchdog_culprit) the rank to blame is the same on every rank: the one
 * the abort key names, else the lowest rank whose heartbeat stopped (a SIGSTOPped process:
 * its watchdog stops too; rank 0 when the store it hosts is silent), else the rank waited for,
 * and the first rank to tell the world decides for the others.
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

/* Writes the world's abort key ("<who> <why>") unless another rank's is there: the first
 * failure told wins (a claim counter decides), so every rank reads the same culprit. */
dtr_result dtr__watchdog_publish(dtr__watchdog *w, int who, const char *why) {
    char key[96], val[256];
    int64_t n = 0;
    dtr_result r;
    dtr__boot_key(w->boot, key, sizeof key, "abort-claim", -1);
    if ((r = dtr_store_add(w->boot->st, key, 1, &n)) != DTR_OK) return r;
    DTR__ATOMIC_STORE(&w->published, 1);
    if (n != 1) return DTR_OK;
    DTR__ATOMIC_STORE(&w->won, 1);   /* another rank's failure is (being) written: the watchdog reads it */
    snprintf(val, sizeof val, "%d %s", who, why);
    dtr__boot_key(w->boot, key, sizeof key, "abort", -1);
    return dtr_store_set(w->boot->st, key, val, strlen(val));
}

static int dtr__watch_abort_key(dtr__watchdog *w, int wait, int *who, char *why, size_t cap);

/* A peer looks dead: unless it left cleanly, break the world naming it. A peer that left
 * after the world failed (it wrote the abort key first: it timed out on a stopped rank, say)
 * brings that failure, not its leaving: every rank then blames the same culprit. */
static void dtr__watch_peer_gone(dtr__watchdog *w, int p, const char *how) {
    char key[96], v[8], why[256];
    size_t len;
    int found = 0, who = -1;
    dtr__boot_key(w->boot, key, sizeof key, "left", p);
    if (dtr_store_check(w->boot->st, key, v, sizeof v, &len, &found) == DTR_OK && found) {
        w->gone[p] = 1;
        if (!w->ops.died && !DTR__ATOMIC_LOAD(&w->heard) && dtr__watch_abort_key(w, 0, &who, why, sizeof why)) {
            w->ops.fail(w->ops.t, who, why, 0);
            DTR__ATOMIC_STORE(&w->published, 1);
            DTR__ATOMIC_STORE(&w->heard, 1);
            return;
        }
        w->ops.left(w->ops.t, p);
        return;
    }
    if (w->ops.died) {   /* isolated: this peer only */
        w->gone[p] = 1;
        w->ops.died(w->ops.t, p, how);
        return;
    }
    /* tell the world first, without the transport's lock: a thread of ours may be stuck
       inside the transport holding it, and the other ranks must learn of the death */
    if (!DTR__ATOMIC_LOAD(&w->published)) dtr__watchdog_publish(w, p, how);
    w->ops.fail(w->ops.t, p, how, !DTR__ATOMIC_LOAD(&w->published));
}

/* Our own failure, not yet told: write it to the abort key. 1 when the store is gone. */
static int dtr__watch_own_failure(dtr__watchdog *w) {
    char why[256];
    int who = -1;
    if (DTR__ATOMIC_LOAD(&w->published)) return 0;
    if (w->ops.to_publish(w->ops.t, &who, why, sizeof why) && dtr__watchdog_publish(w, who, why) != DTR_OK) {
        DTR__ATOMIC_STORE(&w->published, 1);
        return 1;
    }
    DTR__ATOMIC_STORE(&w->published, 1);
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

/* Records peer p's heartbeat value (when it changed: now) and fails the world on a remote
 * peer silent for stale_ns (a local one is watched by pid; its silence only names culprits). */
static void dtr__watch_beat_seen(dtr__watchdog *w, int p, int64_t v, int64_t now) {
    int stale;
    pthread_mutex_lock(&w->mu);
    if (v != w->beat[p] || !w->beat_ns[p]) { w->beat[p] = v; w->beat_ns[p] = now; }
    w->seen_ns[p] = now;
    stale = !w->boot->on_host[p] && now - w->beat_ns[p] > w->stale_ns;
    pthread_mutex_unlock(&w->mu);
    if (stale && !DTR__ATOMIC_LOAD(&w->published)) {
        char how[160];
        snprintf(how, sizeof how, "rank %d stopped answering (no heartbeat for %lld ms)", p,
                 (long long)((now - w->beat_ns[p]) / 1000000));
        dtr__watch_peer_gone(w, p, how);
    }
}

/* The heartbeats of the peers: all of them in worlds up to 64, else one per call round robin. */
static dtr_result dtr__watch_beats(dtr__watchdog *w) {
    const dtr__boot *b = w->boot;
    int k, n = b->size <= 64 ? b->size : 1;
    for (k = 0; k < n; k++) {
        char key[96], val[64];
        size_t len = 0;
        int found = 0, p = w->next_remote;
        dtr_result r;
        w->next_remote = (p + 1) % b->size;
        if (p == b->rank || w->gone[p]) continue;
        dtr__boot_key(w->boot, key, sizeof key, "beat", p);
        if ((r = dtr_store_check(b->st, key, val, sizeof val - 1, &len, &found)) != DTR_OK) return r;
        val[len < sizeof val ? len : sizeof val - 1] = 0;
        dtr__watch_beat_seen(w, p, found ? strtoll(val, NULL, 10) : 0, dtr_time_ns());
    }
    return DTR_OK;
}

static void dtr__watch_nap(dtr__watchdog *w, int ms) {
    pthread_mutex_lock(&w->mu);
    dtr__cond_wait_until(&w->cv, &w->mu, dtr_time_ns() + (int64_t)ms * 1000000);
    pthread_mutex_unlock(&w->mu);
}

/* The world's abort key: 1 with its culprit and reason when it is there (wait: up to the
 * store's deadline for it to appear). */
static int dtr__watch_abort_key(dtr__watchdog *w, int wait, int *who, char *why, size_t cap) {
    char key[96], val[256];
    size_t len = 0;
    int found = 0, off = 0;
    dtr__boot_key(w->boot, key, sizeof key, "abort", -1);
    if (dtr_store_check(w->boot->st, key, val, sizeof val - 1, &len, &found) != DTR_OK) return 0;
    if (!found && (!wait || dtr_store_get(w->boot->st, key, val, sizeof val - 1, &len) != DTR_OK)) return 0;
    val[len < sizeof val ? len : sizeof val - 1] = 0;
    if (sscanf(val, "%d %n", who, &off) < 1) return 0;
    snprintf(why, cap, "%s", val + off);
    return 1;
}

/* Every 100 ms: the world's abort key, our heartbeat, the peers'. DTR_OK, or the error of a
 * store that is gone. Sets *aborted when another rank broke the world. */
static dtr_result dtr__watch_world(dtr__watchdog *w, int *aborted) {
    char key[96], why[256];
    int who = -1;
    dtr_result r = DTR_OK;
    if (!DTR__ATOMIC_LOAD(&w->heard) && dtr__watch_abort_key(w, 0, &who, why, sizeof why)) {
        w->ops.fail(w->ops.t, who, why, 0);
        DTR__ATOMIC_STORE(&w->published, 1);
        DTR__ATOMIC_STORE(&w->heard, 1);
        *aborted = 1;
    }
    dtr__boot_key(w->boot, key, sizeof key, "beat", w->boot->rank);
    r = dtr_store_add(w->boot->st, key, 1, NULL);
    if (r == DTR_OK) r = dtr__watch_beats(w);
    if (r == DTR_OK) {
        pthread_mutex_lock(&w->mu);
        w->ok_ns = dtr_time_ns();
        pthread_mutex_unlock(&w->mu);
    }
    return r;
}

static void *dtr__watch_main(void *arg) {
    dtr__watchdog *w = (dtr__watchdog *)arg;
    int tick = 0, store_dead = 0;
    for (;;) {
        int stop, aborted = 0;
        dtr_result r;
        pthread_mutex_lock(&w->mu);
        if (!w->stop && tick) dtr__cond_wait_until(&w->cv, &w->mu, dtr_time_ns() + (int64_t)DTR__WATCH_TICK_MS * 1000000);
        stop = w->stop;
        w->tick_ns = dtr_time_ns();
        pthread_mutex_unlock(&w->mu);
        if (stop) break;
        if (store_dead) continue;
        if (w->ops.failed(w->ops.t)) store_dead = dtr__watch_own_failure(w);
        else dtr__watch_local_peers(w);
        if (!w->ops.failed(w->ops.t) && w->ops.check) w->ops.check(w->ops.t, w->stale_ns);
        /* the heartbeats go on after a failure: a rank that failed first is not a culprit */
        if (tick++ % 2) continue;
        DTR__ATOMIC_STORE(&w->in_store, 1);
        r = dtr__watch_world(w, &aborted);
        DTR__ATOMIC_STORE(&w->in_store, 0);
        if (r != DTR_OK && !aborted && !DTR__ATOMIC_LOAD(&w->published)) {
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

/* A rank whose heartbeat has not moved for this long names the culprit of a timeout. */
static int64_t dtr__watch_blame_ns(const dtr__watchdog *w) {
    int64_t ms = w->boot->timeout_ms / 2;
    return (ms < 600 ? 600 : ms > 2000 ? 2000 : ms) * (int64_t)1000000;
}

/* The lowest rank (not this one) whose heartbeat stopped for blame_ns, or -1. */
static int dtr__watch_silent(dtr__watchdog *w, int64_t now, int64_t *silent_ns) {
    int p, who = -1;
    pthread_mutex_lock(&w->mu);
    for (p = 0; p < w->boot->size && who < 0; p++)
        if (p != w->boot->rank && !w->gone[p] && w->beat_ns[p] && w->seen_ns[p] - w->beat_ns[p] > dtr__watch_blame_ns(w))
            who = p;   /* silent for blame_ns when last read (large worlds read a peer only now and then) */
    if (who >= 0) *silent_ns = now - w->beat_ns[who];
    pthread_mutex_unlock(&w->mu);
    return who;
}

/* Culprits this rank knows without the store: itself when its own process did not run
 * (SIGSTOP: the watchdog did not tick), rank 0 when the store it hosts is silent; else -1. */
static int dtr__watch_local_culprit(dtr__watchdog *w, int64_t now, char *why, size_t cap) {
    int64_t ok, idle;
    pthread_mutex_lock(&w->mu);
    ok = w->ok_ns;
    idle = now - w->tick_ns;
    pthread_mutex_unlock(&w->mu);
    if (idle > dtr__watch_blame_ns(w) && !DTR__ATOMIC_LOAD(&w->in_store)) {
        snprintf(why, cap, "rank %d itself did not run for %lld ms (stopped?)", w->boot->rank, (long long)(idle / 1000000));
        return w->boot->rank;
    }
    if (ok && now - ok > dtr__watch_blame_ns(w)) {
        snprintf(why, cap, "rank 0 stopped answering (the rendezvous store it hosts has not answered for %lld ms)",
                 (long long)((now - ok) / 1000000));
        return 0;
    }
    return -1;
}

int dtr__watchdog_culprit(dtr__watchdog *w, int suspect, char *why, size_t cap) {
    int64_t now = dtr_time_ns(), silent = 0;
    int who;
    snprintf(why, cap, "%s", "");
    if (!w->inited || !w->on) return suspect;
    if ((who = dtr__watch_local_culprit(w, now, why, cap)) >= 0) return who;
    /* another rank decided, or a rank is silent; on a loaded host the watchdog may not have
       read the silence yet: look again for up to 500 ms (the deadline + 1 s holds) */
    for (;;) {
        if (dtr__watch_abort_key(w, 0, &who, why, cap)) return who;
        if ((who = dtr__watch_silent(w, now, &silent)) >= 0 || dtr_time_ns() - now > (int64_t)500000000) break;
        dtr__watch_nap(w, 50);
    }
    if (who >= 0) snprintf(why, cap, "rank %d stopped answering (no heartbeat for %lld ms; the ranks wait for it)", who,
                           (long long)(silent / 1000000));
    else {
        who = suspect;
        snprintf(why, cap, "rank %d (or a rank it waits for) did not take part in time", who);
    }
    if (dtr__watchdog_publish(w, who, why) != DTR_OK || DTR__ATOMIC_LOAD(&w->won)) return who;
    /* another rank told the world first: take its culprit (it writes the key right after its claim) */
    dtr__watch_abort_key(w, 1, &who, why, cap);
    return who;
}

dtr_result dtr__watchdog_start(dtr__watchdog *w, dtr__boot *b, const dtr__watch_ops *ops) {
    int64_t stale_ms = b->timeout_ms / 2 < 30000 ? b->timeout_ms / 2 : 30000;
    memset(w, 0, sizeof *w);
    w->boot = b;
    w->ops = *ops;
    w->stale_ns = (stale_ms < 2000 ? 2000 : stale_ms) * (int64_t)1000000;
    w->ok_ns = w->tick_ns = dtr_time_ns();
    w->gone = (int *)dtr__calloc(&b->alloc, sizeof(int) * (size_t)b->size);
    w->beat = (int64_t *)dtr__calloc(&b->alloc, sizeof(int64_t) * (size_t)b->size);
    w->beat_ns = (int64_t *)dtr__calloc(&b->alloc, sizeof(int64_t) * (size_t)b->size);
    w->seen_ns = (int64_t *)dtr__calloc(&b->alloc, sizeof(int64_t) * (size_t)b->size);
    pthread_mutex_init(&w->mu, NULL);
    dtr__cond_init(&w->cv);
    w->inited = 1;
    if (!w->gone || !w->beat || !w->beat_ns || !w->seen_ns) return DTR_OUT_OF_MEMORY;
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
    /* after a failure the teardown's store calls (the thread's call in flight, telling the
       failure, "left") end within the grace: a stopped or hung rank 0 answers none of them */
    if (w->boot->st && w->ops.failed(w->ops.t)) dtr__store_cut(w->boot->st);
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
    dtr__free(&w->boot->alloc, w->seen_ns);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    w->inited = 0;
}

#endif /* !_WIN32 */
