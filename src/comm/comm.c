/* ============================================================================
 * Process groups: the transport registry, dtr_comm (create, split, errors, abort), the
 * progress thread that runs non-blocking collectives, requests, point-to-point calls.
 *
 * Execution model. Every collective of a group gets a sequence number when it is called;
 * blocking ones run on the caller's thread when nothing is queued, and *_async ones (and
 * blocking ones called while some are queued) go to the group's FIFO queue, which one
 * progress thread drains in order. So a group runs one collective at a time, in call order,
 * on every rank: the rule that makes collectives match. The progress thread starts on the
 * first queued operation and sleeps on a condition variable while the queue is empty.
 * Send/recv requests go to the transport directly.
 *
 * Errors. A communication failure (DTR_TIMEOUT, DTR_PEER_FAILED) is written once into the
 * group (message naming this rank, the operation and the rank at fault), the transport is
 * aborted so that every other rank fails at once instead of at its own deadline, and the
 * group stays broken: later calls return the error. Argument errors are returned and
 * described without breaking the group.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../core/internal.h"
#include "comm_internal.h"
#include <sys/time.h>

/* ---- clock and timed waits ----
 * The implementation is compiled after the application's own headers, so it cannot ask
 * for POSIX with a feature-test macro. Under strict ISO C (-std=c99) glibc hides
 * clock_gettime, nanosleep and pthread_condattr_setclock although libc has them: they are declared
 * here with the Linux clock ids. Elsewhere CLOCK_MONOTONIC is used when the headers show it,
 * and gettimeofday otherwise; condition variables wait on the monotonic clock on glibc and
 * in slices of at most 100 ms of the real-time clock elsewhere. */
#if defined(__GLIBC__) && !defined(__USE_POSIX199309) && !defined(__cplusplus)
extern int clock_gettime(__clockid_t clock_id, struct timespec *tp);
extern int nanosleep(const struct timespec *req, struct timespec *rem);
#define DTR__CLK_MONO 1
#define DTR__CLK_REAL 0
#define DTR__HAVE_CLOCK 1
#elif defined(CLOCK_MONOTONIC)
#define DTR__CLK_MONO CLOCK_MONOTONIC
#define DTR__CLK_REAL CLOCK_REALTIME
#define DTR__HAVE_CLOCK 1
#else
#define DTR__HAVE_CLOCK 0
#endif
#if DTR__HAVE_CLOCK && defined(__GLIBC__)
#if !defined(__USE_XOPEN2K) && !defined(__cplusplus)
extern int pthread_condattr_setclock(pthread_condattr_t *attr, __clockid_t clock_id);
#endif
#define DTR__COND_MONO 1
#else
#define DTR__COND_MONO 0
#endif

#if !DTR__COND_MONO || !DTR__HAVE_CLOCK
static int64_t dtr__realtime_ns(void) {
#if DTR__HAVE_CLOCK
    struct timespec ts;
    clock_gettime(DTR__CLK_REAL, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#else
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (int64_t)tv.tv_sec * 1000000000 + (int64_t)tv.tv_usec * 1000;
#endif
}
#endif

int64_t dtr_time_ns(void) {
#if DTR__HAVE_CLOCK
    struct timespec ts;
    clock_gettime(DTR__CLK_MONO, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#else
    return dtr__realtime_ns();
#endif
}

int dtr__cond_init(pthread_cond_t *cv) {
#if DTR__COND_MONO
    pthread_condattr_t at;
    int rc;
    if (pthread_condattr_init(&at) != 0) return -1;
    rc = pthread_condattr_setclock(&at, DTR__CLK_MONO);
    if (rc == 0) rc = pthread_cond_init(cv, &at);
    pthread_condattr_destroy(&at);
    return rc;
#else
    return pthread_cond_init(cv, NULL);
#endif
}

int dtr__cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ns) {
    struct timespec ts;
    int64_t now, t;
    if (deadline_ns < 0) { pthread_cond_wait(cv, mu); return 0; }
    now = dtr_time_ns();
    if (now >= deadline_ns) return 1;
#if DTR__COND_MONO
    t = deadline_ns;
#else
    { /* the real-time clock: at most 100 ms at a time, so that a clock jump costs little */
        int64_t d = deadline_ns - now;
        if (d > 100000000) d = 100000000;
        t = dtr__realtime_ns() + d;
    }
#endif
    ts.tv_sec = (time_t)(t / 1000000000);
    ts.tv_nsec = (long)(t % 1000000000);
    pthread_cond_timedwait(cv, mu, &ts);
    return dtr_time_ns() >= deadline_ns;
}

/* ---- names ---- */

const char *dtr_reduce_op_name(dtr_reduce_op op) {
    switch (op) {
    case DTR_REDUCE_SUM: return "sum";
    case DTR_REDUCE_AVG: return "avg";
    case DTR_REDUCE_MAX: return "max";
    }
    return "unknown";
}

const char *dtr_allreduce_algo_name(dtr_allreduce_algo algo) {
    switch (algo) {
    case DTR_ALLREDUCE_AUTO: return "auto";
    case DTR_ALLREDUCE_RING: return "ring";
    case DTR_ALLREDUCE_RECURSIVE_DOUBLING: return "recursive_doubling";
    case DTR_ALLREDUCE_HIERARCHICAL: return "hierarchical";
    }
    return "unknown";
}

const char *dtr__coll_name(int kind) {
    static const char *const names[DTR__OP_COUNT] = {"all_reduce", "broadcast", "reduce_scatter", "all_gather",
                                                     "barrier", "send", "recv", "split"};
    return kind >= 0 && kind < DTR__OP_COUNT ? names[kind] : "operation";
}

/* ---- transport registry ---- */

#define DTR__MAX_TRANSPORTS 32
static pthread_mutex_t dtr__registry_mu = PTHREAD_MUTEX_INITIALIZER;
static const dtr_transport_vtable *dtr__registry[DTR__MAX_TRANSPORTS];
static int dtr__registry_n;

dtr_result dtr_transport_register(const dtr_transport_vtable *vt) {
    dtr_result r = DTR_OK;
    int i;
    if (!vt) return DTR_NULL_HANDLE;
    if (vt->abi_version != DTR_VERSION_NUMBER) return DTR_VERSION_MISMATCH;
    if (!vt->name || !*vt->name || !vt->open || !vt->close || !vt->isend || !vt->irecv || !vt->test ||
        !vt->wait_any || !vt->release || !vt->abort)
        return DTR_INVALID_ARGUMENT;
    if (!strcmp(vt->name, "local")) return vt == dtr_local_transport() ? DTR_OK : DTR_INVALID_ARGUMENT;
    pthread_mutex_lock(&dtr__registry_mu);
    for (i = 0; i < dtr__registry_n; i++)
        if (!strcmp(dtr__registry[i]->name, vt->name)) { r = dtr__registry[i] == vt ? DTR_OK : DTR_INVALID_ARGUMENT; goto out; }
    if (dtr__registry_n == DTR__MAX_TRANSPORTS) { r = DTR_OUT_OF_MEMORY; goto out; }
    dtr__registry[dtr__registry_n++] = vt;
out:
    pthread_mutex_unlock(&dtr__registry_mu);
    return r;
}

/* dtrain_comm.c's transport is found by name when that unit is linked (a weak reference:
   without the unit the address is NULL) */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__ELF__)
extern const dtr_transport_vtable *dtr_fabric_transport(void) __attribute__((weak));
extern const dtr_transport_vtable *dtr_nccl_transport(void) __attribute__((weak));
#define DTR__WEAK_FABRIC 1
#else
#define DTR__WEAK_FABRIC 0
#endif

const dtr_transport_vtable *dtr_transport_find(const char *name) {
    const dtr_transport_vtable *vt = NULL;
    int i;
    if (!name) return NULL;
    if (!strcmp(name, "local")) return dtr_local_transport();
#if DTR__WEAK_FABRIC
    if (!strcmp(name, "libfabric") && dtr_fabric_transport) {
        vt = dtr_fabric_transport();
        if (vt) return vt;
    }
    if (!strcmp(name, "nccl") && dtr_nccl_transport) {
        vt = dtr_nccl_transport();
        if (vt) return vt;
    }
#endif
    pthread_mutex_lock(&dtr__registry_mu);
    for (i = 0; i < dtr__registry_n; i++)
        if (!strcmp(dtr__registry[i]->name, name)) { vt = dtr__registry[i]; break; }
    pthread_mutex_unlock(&dtr__registry_mu);
    return vt;
}

/* ---- configuration and lifetime ---- */

dtr_comm_config dtr_comm_config_init(void) {
    dtr_comm_config c;
    memset(&c, 0, sizeof(c));
    c.allreduce_algo = DTR_ALLREDUCE_AUTO;
    c.log_level = DTR_LOG_WARN;
    c.memory = DTR_MEM_HOST;
    c.nccl.device = -1;
    c.shared_memory = 1;
    return c;
}

static void dtr__endpoint_unref(dtr__endpoint *ep) {
    int last;
    dtr_allocation_callbacks a;
    pthread_mutex_lock(&ep->mu);
    last = --ep->refs == 0;
    pthread_mutex_unlock(&ep->mu);
    if (!last) return;
    ep->vt->close(ep->state);
    pthread_mutex_destroy(&ep->mu);
    a = ep->alloc;
    dtr__free(&a, ep);
}

/* A group object over endpoint ep (one more reference to it) with `size` ranks. */
static dtr_result dtr__comm_new(dtr__endpoint *ep, int size, dtr_comm **out) {
    dtr_comm *c = (dtr_comm *)dtr__calloc(&ep->alloc, sizeof(*c));
    *out = NULL;
    if (!c) return DTR_OUT_OF_MEMORY;
    c->ranks = (int *)dtr__calloc(&ep->alloc, (size_t)size * sizeof(int));
    if (!c->ranks) { dtr__free(&ep->alloc, c); return DTR_OUT_OF_MEMORY; }
    if (pthread_mutex_init(&c->mu, NULL) != 0) goto fail;
    if (dtr__cond_init(&c->work_cv) != 0) { pthread_mutex_destroy(&c->mu); goto fail; }
    if (dtr__cond_init(&c->done_cv) != 0) {
        pthread_cond_destroy(&c->work_cv);
        pthread_mutex_destroy(&c->mu);
        goto fail;
    }
    c->ep = ep;
    c->size = size;
    c->failed_rank = -1;
    pthread_mutex_lock(&ep->mu);
    ep->refs++;
    pthread_mutex_unlock(&ep->mu);
    *out = c;
    return DTR_OK;
fail:
    dtr__free(&ep->alloc, c->ranks);
    dtr__free(&ep->alloc, c);
    return DTR_OUT_OF_MEMORY;
}

static void dtr__comm_config_apply(dtr_comm *c, const dtr_comm_config *cfg) {
    c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : dtr__default_timeout_ms();   /* DTR_TIMEOUT_MS */
    c->algo = (int)cfg->allreduce_algo;
    c->ring_threshold = cfg->ring_threshold_bytes ? cfg->ring_threshold_bytes : (size_t)256 << 10;
    c->chain_threshold = cfg->chain_threshold_bytes ? cfg->chain_threshold_bytes : (size_t)1 << 20;
    c->segment = cfg->segment_bytes ? cfg->segment_bytes : (size_t)256 << 10;
    c->no_native = cfg->no_native;
    c->shm_wanted = cfg->shared_memory;
    c->log = cfg->log;
    c->log_user = cfg->log_user;
    c->log_level = cfg->log_level;
}

/* The memory kind of the group's buffers must be one the transport takes. */
static dtr_result dtr__comm_check_memory(const dtr_comm_config *cfg, const dtr_transport_vtable *vt, char *err, size_t errlen) {
    unsigned kinds = vt->mem_kinds ? vt->mem_kinds : (unsigned)DTR_MEM_HOST;
    dtr_mem_kind mem = cfg->memory ? cfg->memory : DTR_MEM_HOST;
    if (mem != DTR_MEM_HOST && mem != DTR_MEM_DEVICE)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_comm_create: memory %d is not a dtr_mem_kind", (int)mem);
    if (mem == DTR_MEM_DEVICE && !cfg->context)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_comm_create: device memory needs cfg.context (the owner)");
    if (kinds & (unsigned)mem) return DTR_OK;
    /* device memory over a host transport: staged when the backend tells its memory apart */
    if (mem == DTR_MEM_DEVICE && (kinds & (unsigned)DTR_MEM_HOST) &&
        (dtr__host_memory(cfg->context) || cfg->context->backend->owns))
        return DTR_OK;
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "dtr_comm_create: transport '%s' does not take %s memory%s", vt->name,
                     mem == DTR_MEM_DEVICE ? "device" : "host",
                     mem == DTR_MEM_DEVICE && (kinds & (unsigned)DTR_MEM_HOST) ? " and the backend cannot tell its memory "
                     "from the host's (no `owns` slot) for staging" : "");
}

/* the group's memory: device memory the transport takes (mem_ctx; host buffers staged to
   the device when it takes no host memory), or device memory staged to the host (stage_ctx) */
static void dtr__comm_set_memory(dtr_comm *c, const dtr_comm_config *cfg) {
    unsigned kinds = c->ep->vt->mem_kinds ? c->ep->vt->mem_kinds : (unsigned)DTR_MEM_HOST;
    dtr_context *ctx = cfg->context;
    if (cfg->memory != DTR_MEM_DEVICE) return;
    if (kinds & (unsigned)DTR_MEM_DEVICE) {
        c->mem_ctx = ctx;
        if (!(kinds & (unsigned)DTR_MEM_HOST) && ctx->backend->owns) c->stage_ctx = ctx, c->stage_to_dev = 1;
    } else if (!dtr__host_memory(ctx)) {
        c->stage_ctx = ctx;   /* (a CPU's "device" memory is the host's) */
    }
}

dtr_result dtr_comm_create(const dtr_comm_config *cfg, dtr_comm **out, char *err, size_t errlen) {
    dtr_comm_config def = dtr_comm_config_init();
    const dtr_transport_vtable *vt;
    const dtr_allocation_callbacks *a;
    dtr__endpoint *ep;
    dtr_comm *c;
    dtr_result r;
    int i;
    if (err && errlen) err[0] = 0;
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_comm_create: out is NULL");
    *out = NULL;
    if (!cfg) cfg = &def;
    a = &cfg->alloc;
    if ((a->malloc_fn || a->realloc_fn || a->free_fn) && !(a->malloc_fn && a->realloc_fn && a->free_fn))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_comm_create: set all three allocation callbacks or none");
    if (cfg->timeout_ms < 0 || (int)cfg->allreduce_algo < 0 || cfg->allreduce_algo > DTR_ALLREDUCE_RECURSIVE_DOUBLING)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_comm_create: bad timeout_ms or allreduce_algo");
    vt = cfg->transport_vtable ? cfg->transport_vtable : dtr_transport_find(cfg->transport ? cfg->transport : "local");
    if (!vt)
        return dtr__errf(err, errlen, DTR_NOT_FOUND, "dtr_comm_create: no transport '%s' is registered%s", cfg->transport,
                         !strcmp(cfg->transport, "libfabric") ? " (link dtrain_comm.c built with DTR_USE_LIBFABRIC and "
                                                                "register its transport)" : "");
    if (vt->abi_version != DTR_VERSION_NUMBER)
        return dtr__errf(err, errlen, DTR_VERSION_MISMATCH, "dtr_comm_create: transport '%s' was built against dtrain %d, "
                         "this is %d", vt->name ? vt->name : "?", vt->abi_version, DTR_VERSION_NUMBER);
    r = dtr__comm_check_memory(cfg, vt, err, errlen);
    if (r != DTR_OK) return r;
    ep = (dtr__endpoint *)dtr__calloc(a, sizeof(*ep));
    if (!ep) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "dtr_comm_create: out of memory");
    ep->alloc = *a;
    ep->vt = vt;
    if (pthread_mutex_init(&ep->mu, NULL) != 0) {
        dtr__free(a, ep);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "dtr_comm_create: cannot make a mutex");
    }
    r = vt->open(cfg, &ep->state, &ep->info, err, errlen);
    if (r == DTR_OK && (ep->info.size < 1 || ep->info.rank < 0 || ep->info.rank >= ep->info.size)) {
        vt->close(ep->state);
        r = dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "dtr_comm_create: transport '%s' reported rank %d of %d",
                      vt->name, ep->info.rank, ep->info.size);
    }
    if (r != DTR_OK) {
        pthread_mutex_destroy(&ep->mu);
        dtr__free(a, ep);
        return r;
    }
    ep->next_ctx = 1;   /* 0 is the world group */
    ep->isolate = cfg->isolate_peer_failures && vt->peer_alive;
    r = dtr__comm_new(ep, ep->info.size, &c);   /* the group holds the only reference */
    if (r != DTR_OK) {
        vt->close(ep->state);
        pthread_mutex_destroy(&ep->mu);
        dtr__free(a, ep);
        return dtr__errf(err, errlen, r, "dtr_comm_create: out of memory");
    }
    c->rank = ep->info.rank;
    c->local_rank = ep->info.local_rank;
    c->local_size = ep->info.local_size > 0 ? ep->info.local_size : 1;
    for (i = 0; i < c->size; i++) c->ranks[i] = i;
    c->ctx = 0;
    dtr__comm_set_memory(c, cfg);
    dtr__comm_config_apply(c, cfg);
    if ((r = dtr__flight_init(c, cfg->flight_records, cfg->flight_dir)) != DTR_OK) {
        dtr_comm_destroy(c);
        return dtr__errf(err, errlen, r, "dtr_comm_create: out of memory");
    }
    if (vt->group_create && !c->no_native) {
        r = vt->group_create(ep->state, c->ranks, c->size, c->ctx, &c->native_group);
        if (r != DTR_OK) c->native_group = NULL;   /* fall back to point-to-point */
    }
    if (!c->native_group && (r = dtr__shm_setup(c)) != DTR_OK) {
        dtr__errf(err, errlen, r, "dtr_comm_create: %s", c->msg);
        dtr_comm_destroy(c);
        return r;
    }
    *out = c;
    return DTR_OK;
}

/* the scratch's memory: the host's, or a device group's backend's */
static void dtr__scratch_free(dtr_comm *c) {
    if (c->scratch && c->mem_ctx) c->mem_ctx->backend->mem_free(c->mem_ctx, c->scratch);
    else dtr__free(&c->ep->alloc, c->scratch);
    c->scratch = NULL;
    c->scratch_cap = 0;
}

static void dtr__comm_stop_thread(dtr_comm *c) {
    int on;
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    on = c->thread_on;
    pthread_cond_broadcast(&c->work_cv);
    pthread_mutex_unlock(&c->mu);
    if (on) pthread_join(c->thread, NULL);
    c->thread_on = 0;
}

void dtr_comm_destroy(dtr_comm *c) {
    dtr_allocation_callbacks a;
    dtr__endpoint *ep;
    dtr_request *q, *n;
    int pending;
    if (!c) return;
    ep = c->ep;
    a = ep->alloc;
    pthread_mutex_lock(&c->mu);
    pending = c->head != NULL || c->running != NULL;
    pthread_mutex_unlock(&c->mu);
    if (pending) {
        char why[160];
        snprintf(why, sizeof why, "rank %d destroyed its group with collectives still in flight", ep->info.rank);
        ep->vt->abort(ep->state, ep->info.rank, why);
    }
    dtr__comm_stop_thread(c);
    dtr_comm_destroy(c->leaders);
    dtr_comm_destroy(c->host);
    dtr__shm_free(c);
    dtr__flight_free(c);
    /* requests never run (stopped queue) complete with an error; their memory is freed below,
       so the caller must not use them any more (documented: free requests before destroy) */
    for (q = c->head; q; q = n) { n = q->next; dtr__stage_out(c, &q->a, &q->st, DTR_BAD_STATE); dtr__free(&a, q); }
    for (q = c->free_reqs; q; q = n) { n = q->next; dtr__free(&a, q); }
    dtr__stage_free_all(c);
    if (c->native_group && ep->vt->group_destroy) ep->vt->group_destroy(ep->state, c->native_group);
    pthread_cond_destroy(&c->work_cv);
    pthread_cond_destroy(&c->done_cv);
    pthread_mutex_destroy(&c->mu);
    dtr__scratch_free(c);
    dtr__free(&a, c->ranks);
    dtr__free(&a, c);
    dtr__endpoint_unref(ep);
}

/* ---- queries ---- */

int dtr_comm_rank(const dtr_comm *c) { return c ? c->rank : -1; }
int dtr_comm_size(const dtr_comm *c) { return c ? c->size : 0; }
int dtr_comm_local_rank(const dtr_comm *c) { return c ? c->local_rank : -1; }
int dtr_comm_local_size(const dtr_comm *c) { return c ? c->local_size : 0; }
int dtr_comm_world_rank(const dtr_comm *c, int rank) {
    return c && rank >= 0 && rank < c->size ? c->ranks[rank] : -1;
}
const char *dtr_comm_transport_name(const dtr_comm *c) { return c ? c->ep->vt->name : ""; }
const char *dtr_comm_transport_detail(const dtr_comm *c) { return c ? c->ep->info.detail : ""; }

dtr_result dtr_comm_status(const dtr_comm *c) {
    dtr_result r;
    if (!c) return DTR_NULL_HANDLE;
    pthread_mutex_lock((pthread_mutex_t *)&c->mu);
    r = c->status;
    pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
    return r;
}

int dtr_comm_peer_alive(const dtr_comm *c, int rank) {
    if (!c || rank < 0 || rank >= c->size) return -1;
    if (!c->ep->vt->peer_alive || rank == c->rank) return 1;
    return c->ep->vt->peer_alive(c->ep->state, c->ranks[rank]) ? 1 : 0;
}

int dtr_comm_isolates_peer_failures(const dtr_comm *c) { return c ? c->ep->isolate : 0; }

const char *dtr_comm_last_error(const dtr_comm *c) { return c ? c->msg : "null group"; }
int dtr_comm_failed_rank(const dtr_comm *c) { return c ? c->failed_rank : -1; }
int dtr_comm_native_error(const dtr_comm *c) { return c ? c->native_code : 0; }

dtr_result dtr_comm_set_timeout(dtr_comm *c, int timeout_ms) {
    if (!c) return DTR_NULL_HANDLE;
    if (timeout_ms <= 0) return DTR_INVALID_ARGUMENT;
    c->timeout_ms = timeout_ms;
    return DTR_OK;
}

/* The host and leaders groups of the hierarchical all-reduce (collective over c), and
 * whether it changes anything: several hosts, one of several ranks (the same on all ranks). */
static dtr_result dtr__comm_hier_groups(dtr_comm *c) {
    int host = c->ep->info.rank - c->ep->info.local_rank; /* its first rank: ranks of a host are contiguous */
    float shape[2];
    dtr_result r;
    if (c->hier_ready) return DTR_OK;
    r = dtr_comm_split(c, host, c->rank, &c->host);
    if (r == DTR_OK) r = dtr_comm_split(c, dtr_comm_rank(c->host) == 0 ? 0 : DTR_COMM_UNDEFINED, c->rank, &c->leaders);
    shape[0] = c->leaders ? 1.0f : 0.0f;                            /* hosts */
    shape[1] = (float)dtr_comm_size(c->host);                     /* the biggest host */
    if (r == DTR_OK) r = dtr_comm_all_reduce(c, shape, shape, 1, DTR_F32, DTR_REDUCE_SUM);
    if (r == DTR_OK) r = dtr_comm_all_reduce(c, shape + 1, shape + 1, 1, DTR_F32, DTR_REDUCE_MAX);
    if (r != DTR_OK) return r;
    c->hier_ready = 1;
    c->hier_on = shape[0] > 1.5f && shape[1] > 1.5f && !c->mem_ctx;
    return DTR_OK;
}

dtr_result dtr_comm_set_allreduce_algo(dtr_comm *c, dtr_allreduce_algo algo, size_t ring_threshold_bytes) {
    dtr_result r;
    if (!c) return DTR_NULL_HANDLE;
    if ((int)algo < 0 || algo > DTR_ALLREDUCE_HIERARCHICAL) return DTR_INVALID_ARGUMENT;
    if (algo == DTR_ALLREDUCE_HIERARCHICAL && (r = dtr__comm_hier_groups(c)) != DTR_OK) return r;
    c->algo = (int)algo;
    if (ring_threshold_bytes) c->ring_threshold = ring_threshold_bytes;
    if (c->host) c->host->ring_threshold = c->ring_threshold;
    if (c->leaders) c->leaders->ring_threshold = c->ring_threshold;
    return DTR_OK;
}

void dtr_comm_abort(dtr_comm *c, const char *why) {
    char msg[200];
    if (!c) return;
    snprintf(msg, sizeof msg, "rank %d aborted the group: %s", c->ep->info.rank, why ? why : "(no reason given)");
    pthread_mutex_lock(&c->mu);
    if (c->status == DTR_OK || c->status == DTR_INVALID_ARGUMENT) {
        c->status = DTR_PEER_FAILED;
        c->failed_rank = c->ep->info.rank;
        snprintf(c->msg, sizeof(c->msg), "%s", msg);
    }
    pthread_mutex_unlock(&c->mu);
    c->ep->vt->abort(c->ep->state, c->ep->info.rank, msg);
}

/* ---- errors ---- */

static int dtr__is_comm_failure(dtr_result r) { return r == DTR_TIMEOUT || r == DTR_PEER_FAILED; }

dtr_result dtr__comm_fail(dtr_comm *c, const dtr__coll *a, dtr_result code, int peer, int native_code, const char *fmt,
                          ...) {
    char what[300], head[160];
    va_list ap;
    int first = 0;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (a && a->kind == DTR__OP_ALL_REDUCE)
        snprintf(head, sizeof head, "rank %d/%d all_reduce #%u (%zu x %s, %s, %s)", c->rank, c->size, a->seq, a->count,
                 dtr_dtype_name(a->dtype), dtr_reduce_op_name(a->op), dtr_allreduce_algo_name((dtr_allreduce_algo)a->algo));
    else if (a && (a->kind == DTR__OP_SEND || a->kind == DTR__OP_RECV))
        snprintf(head, sizeof head, "rank %d/%d %s (%zu bytes, %s rank %d, tag %d)", c->rank, c->size,
                 dtr__coll_name(a->kind), a->count, a->kind == DTR__OP_SEND ? "to" : "from", a->root, a->tag);
    else if (a)
        snprintf(head, sizeof head, "rank %d/%d %s #%u (%zu x %s)", c->rank, c->size, dtr__coll_name(a->kind), a->seq,
                 a->count, dtr_dtype_name(a->dtype));
    else
        snprintf(head, sizeof head, "rank %d/%d", c->rank, c->size);
    pthread_mutex_lock(&c->mu);
    if (!dtr__is_comm_failure(c->status)) {
        first = 1;
        if (dtr__is_comm_failure(code)) {
            c->status = code;
            c->failed_rank = peer;
            c->native_code = native_code;
        }
        snprintf(c->msg, sizeof(c->msg), "%s: %s", head, what);
    }
    pthread_mutex_unlock(&c->mu);
    if (first && c->log && c->log_level >= DTR_LOG_ERROR) c->log(c->log_user, DTR_LOG_ERROR, c->msg);
    if (first && dtr__is_comm_failure(code)) dtr__flight_failure(c, code);
    if (dtr__is_comm_failure(code)) {
        char why[200];
        snprintf(why, sizeof why, "%.80s: %.110s", head, what);
        c->ep->vt->abort(c->ep->state, peer, why);
    }
    return code;
}

/* ---- point-to-point building blocks of the algorithms ---- */

static void dtr__terr_clear(dtr_transport_error *e) {
    e->rank = -1;
    e->native_code = 0;
    e->msg[0] = 0;
}

dtr_result dtr__comm_waitall(dtr_comm *c, const dtr__coll *a, void **reqs, int n) {
    const dtr_transport_vtable *vt = c->ep->vt;
    void *st = c->ep->state;
    dtr_transport_error e;
    dtr_result r = DTR_OK;
    int i, left;
    dtr__terr_clear(&e);
    for (;;) {
        left = 0;
        for (i = 0; i < n; i++) {
            int done = 0;
            if (!reqs[i]) continue;
            r = vt->test(st, reqs[i], &done, &e);
            if (r != DTR_OK) goto fail;
            if (done) { vt->release(st, reqs[i]); reqs[i] = NULL; }
            else left++;
        }
        if (!left) return DTR_OK;
        r = vt->wait_any(st, reqs, n, a->deadline, &e);
        if (r != DTR_OK) goto fail;
    }
fail:
    for (i = 0; i < n; i++)
        if (reqs[i]) { vt->release(st, reqs[i]); reqs[i] = NULL; }
    if (r == DTR_TIMEOUT)
        return dtr__comm_fail(c, a, r, e.rank, e.native_code, "timed out after %d ms: %s", a->timeout_ms, e.msg);
    return dtr__comm_fail(c, a, r, e.rank, e.native_code, "%s", e.msg[0] ? e.msg : dtr_result_string(r));
}

dtr_result dtr__comm_sendrecv(dtr_comm *c, const dtr__coll *a, const void *sbuf, size_t sbytes, int to, void *rbuf,
                              size_t rbytes, int from, uint32_t step) {
    const dtr_transport_vtable *vt = c->ep->vt;
    void *reqs[2] = {NULL, NULL};
    uint64_t tag = dtr__tag_coll(c->ctx, a->seq, step);
    dtr_transport_error e;
    dtr_result r;
    dtr__terr_clear(&e);
    if (from >= 0) {
        r = vt->irecv(c->ep->state, rbuf, rbytes, c->ranks[from], tag, &reqs[1], &e);
        if (r != DTR_OK) return dtr__comm_fail(c, a, r, e.rank, e.native_code, "%s", e.msg);
    }
    if (to >= 0) {
        r = vt->isend(c->ep->state, sbuf, sbytes, c->ranks[to], tag, &reqs[0], &e);
        if (r != DTR_OK) {
            if (reqs[1]) vt->release(c->ep->state, reqs[1]);
            return dtr__comm_fail(c, a, r, e.rank, e.native_code, "%s", e.msg);
        }
    }
    return dtr__comm_waitall(c, a, reqs, 2);
}

void *dtr__comm_scratch(dtr_comm *c, size_t bytes) {
    if (bytes > c->scratch_cap) {
        void *p = c->mem_ctx ? c->mem_ctx->backend->mem_alloc(c->mem_ctx, bytes) : dtr__malloc(&c->ep->alloc, bytes);
        if (!p) return NULL;
        dtr__scratch_free(c);
        c->scratch = p;
        c->scratch_cap = bytes;
    }
    return c->scratch ? c->scratch : (void *)c;   /* a valid pointer even for 0 bytes */
}

/* ---- the queue and the progress thread ---- */

/* Runs the request at the head of the queue on the calling thread. Called and returns with
 * c->mu held; the collective itself runs unlocked. Wakes waiters of its completion and the
 * progress thread (which waits while another thread runs the head). */
static void dtr__comm_run_head(dtr_comm *c) {
    dtr_request *q = c->head;
    dtr_result r;
    c->head = q->next;
    if (!c->head) c->tail = NULL;
    q->state = DTR__REQ_RUNNING;
    c->running = q;
    r = c->status;
    pthread_mutex_unlock(&c->mu);
    if (!dtr__is_comm_failure(r)) r = dtr__coll_run(c, &q->a);
    pthread_mutex_lock(&c->mu);
    q->result = r;
    q->state = DTR__REQ_DONE;
    c->running = NULL;
    pthread_cond_broadcast(&c->done_cv);
    pthread_cond_broadcast(&c->work_cv);
}

static void *dtr__comm_thread(void *arg) {
    dtr_comm *c = (dtr_comm *)arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        /* a waiting caller may be running the head itself (dtr_request_wait): wait for it */
        while ((!c->head || c->running) && !c->stop) dtr__cond_wait_until(&c->work_cv, &c->mu, -1);
        while (c->running) dtr__cond_wait_until(&c->work_cv, &c->mu, -1);
        if (!c->head) break;    /* stop, and nothing left */
        dtr__comm_run_head(c);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* back to the free list, never handed out */
static void dtr__req_put(dtr_comm *c, dtr_request *q) {
    pthread_mutex_lock(&c->mu);
    q->next = c->free_reqs;
    c->free_reqs = q;
    pthread_mutex_unlock(&c->mu);
}

/* a completed collective's device destination gets its result (once; stage.c) */
static void dtr__req_settle(dtr_request *q) {
    dtr_result r;
    if (!q->st.blk) return;
    r = dtr__stage_out(q->comm, &q->a, &q->st, q->result);
    pthread_mutex_lock(&q->comm->mu);
    q->result = r;
    pthread_mutex_unlock(&q->comm->mu);
}

static dtr_request *dtr__req_get(dtr_comm *c) {
    dtr_request *q;
    pthread_mutex_lock(&c->mu);
    q = c->free_reqs;
    if (q) c->free_reqs = q->next;
    pthread_mutex_unlock(&c->mu);
    if (!q && !(q = (dtr_request *)dtr__malloc(&c->ep->alloc, sizeof(*q)))) return NULL;
    memset(q, 0, sizeof(*q));
    q->comm = c;
    return q;
}

/* Queues q (state QUEUED) and starts the progress thread if needed. */
static dtr_result dtr__comm_enqueue(dtr_comm *c, dtr_request *q) {
    dtr_result r = DTR_OK;
    pthread_mutex_lock(&c->mu);
    if (!c->thread_on) {
        c->stop = 0;
        if (pthread_create(&c->thread, NULL, dtr__comm_thread, c) != 0) r = DTR_OUT_OF_MEMORY;
        else c->thread_on = 1;
    }
    if (r == DTR_OK) {
        q->state = DTR__REQ_QUEUED;
        q->next = NULL;
        if (c->tail) c->tail->next = q;
        else c->head = q;
        c->tail = q;
        pthread_cond_signal(&c->work_cv);
    }
    pthread_mutex_unlock(&c->mu);
    return r;
}

int dtr__auto_algo(const dtr_comm *c, size_t count, dtr_dtype dt) {
    return count * dtr_dtype_size(dt) >= c->ring_threshold && count >= (size_t)c->size ? DTR_ALLREDUCE_RING
                                                                                        : DTR_ALLREDUCE_RECURSIVE_DOUBLING;
}

/* Checks arguments (an error here breaks nothing), stamps the sequence number and deadline. */
static dtr_result dtr__coll_prepare(dtr_comm *c, dtr__coll *a) {
    size_t es;
    dtr_result st;
    if (!c) return DTR_NULL_HANDLE;
    st = dtr_comm_status(c);
    if (dtr__is_comm_failure(st)) return st;
    es = dtr_dtype_size(a->dtype);
    if (a->kind != DTR__OP_SEND && a->kind != DTR__OP_RECV && a->kind != DTR__OP_BARRIER) {
        if (!es) return dtr__comm_fail(c, a, DTR_DTYPE_MISMATCH, -1, 0, "unknown dtype %d", (int)a->dtype);
        if (a->count && ((!a->src && a->kind != DTR__OP_BROADCAST) || !a->dst))
            return dtr__comm_fail(c, a, DTR_NULL_HANDLE, -1, 0, "a buffer is NULL");
        if (a->count > (SIZE_MAX / 2) / es / (size_t)c->size)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "count too large");
    }
    if (a->kind == DTR__OP_ALL_REDUCE || a->kind == DTR__OP_REDUCE_SCATTER) {
        if (!dtr__is_float(a->dtype))
            return dtr__comm_fail(c, a, DTR_DTYPE_MISMATCH, -1, 0, "reductions take f32, bf16 or f16, not %s",
                                  dtr_dtype_name(a->dtype));
        if ((int)a->op < 0 || a->op > DTR_REDUCE_MAX)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "unknown reduction %d", (int)a->op);
    }
    if (a->kind == DTR__OP_ALL_REDUCE && a->src != a->dst && a->count) {
        const char *s = (const char *)a->src, *d = (const char *)a->dst;
        size_t b = a->count * es;
        if (s < d + b && d < s + b)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "src and dst overlap without being equal");
    }
    if (a->kind == DTR__OP_REDUCE_SCATTER && a->count) {
        const char *s = (const char *)a->src, *d = (const char *)a->dst;
        size_t b = a->count * es;
        if (s < d + b && d < s + b * (size_t)c->size)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "dst overlaps src");
    }
    if (a->kind == DTR__OP_ALL_GATHER && a->count) {
        const char *s = (const char *)a->src, *d = (const char *)a->dst;
        size_t b = a->count * es;
        if (s != d + b * (size_t)c->rank && s < d + b * (size_t)c->size && d < s + b)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "src overlaps dst (in place is src == dst + rank*count)");
    }
    if (a->kind == DTR__OP_BROADCAST && (a->root < 0 || a->root >= c->size))
        return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "root %d outside the group of %d", a->root, c->size);
    if (a->kind == DTR__OP_SEND || a->kind == DTR__OP_RECV) {
        if (a->root < 0 || a->root >= c->size)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "peer %d outside the group of %d", a->root, c->size);
        if (a->root == c->rank)
            return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "a rank cannot send to itself");
        if (a->tag < 0) return dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "tag %d is negative", a->tag);
        if (a->count && !(a->kind == DTR__OP_SEND ? a->src : (const void *)a->dst))
            return dtr__comm_fail(c, a, DTR_NULL_HANDLE, -1, 0, "the buffer is NULL");
    }
    if (a->kind == DTR__OP_ALL_REDUCE) a->algo = c->algo != DTR_ALLREDUCE_AUTO ? c->algo : dtr__auto_algo(c, a->count, a->dtype);
    if (a->kind != DTR__OP_SEND && a->kind != DTR__OP_RECV) a->seq = c->seq++;
    a->timeout_ms = c->timeout_ms;
    a->deadline = dtr_time_ns() + (int64_t)c->timeout_ms * 1000000;
    return DTR_OK;
}

/* Runs a prepared collective: inline when the queue is idle, else behind the queue. */
static dtr_result dtr__coll_queue_wait(dtr_comm *c, dtr__coll *a) {
    dtr_result r;
    int idle;
    pthread_mutex_lock(&c->mu);
    idle = !c->head && !c->running;
    if (idle) c->inline_running = 1;
    pthread_mutex_unlock(&c->mu);
    if (idle) {
        r = dtr__coll_run(c, a);
        pthread_mutex_lock(&c->mu);
        c->inline_running = 0;
        pthread_mutex_unlock(&c->mu);
        return r;
    } else {
        dtr_request *q = dtr__req_get(c);
        if (!q) return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory");
        q->a = *a;
        pthread_mutex_lock(&c->mu);
        c->live_reqs++;
        pthread_mutex_unlock(&c->mu);
        r = dtr__comm_enqueue(c, q);
        if (r == DTR_OK) r = dtr_request_wait(q);
        else { q->state = DTR__REQ_DONE; q->result = r; }
        dtr_request_destroy(q);
        return r;
    }
}

/* A collective called blocking: prepared, device buffers through host images (stage.c), run. */
static dtr_result dtr__coll_blocking(dtr_comm *c, dtr__coll *a) {
    dtr__staged st;
    dtr_result r = dtr__coll_prepare(c, a);
    if (r == DTR_OK && (r = dtr__stage_in(c, a, &st)) != DTR_OK) dtr__coll_cannot(c, a, r);
    if (r != DTR_OK) return r;
    return dtr__stage_out(c, a, &st, dtr__coll_queue_wait(c, a));
}

static dtr_result dtr__coll_async(dtr_comm *c, dtr__coll *a, dtr_request **out) {
    dtr_request *q;
    dtr_result r;
    if (!out) return DTR_NULL_HANDLE;
    *out = NULL;
    r = dtr__coll_prepare(c, a);
    if (r != DTR_OK) return r;
    q = dtr__req_get(c);
    if (!q) return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory");
    if ((r = dtr__stage_in(c, a, &q->st)) != DTR_OK) {
        dtr__req_put(c, q);
        return dtr__coll_cannot(c, a, r);
    }
    q->a = *a;
    pthread_mutex_lock(&c->mu);
    c->live_reqs++;
    pthread_mutex_unlock(&c->mu);
    if (c->size == 1) { /* nothing to wait for: run it here */
        q->result = dtr__coll_run(c, &q->a);
        q->state = DTR__REQ_DONE;
    } else if ((r = dtr__comm_enqueue(c, q)) != DTR_OK) {
        q->state = DTR__REQ_DONE;
        q->result = dtr__comm_fail(c, a, r, -1, 0, "cannot start the progress thread");
    }
    *out = q;
    return DTR_OK;
}

/* ---- requests ---- */

/* Isolated groups: a send/recv that failed because its peer is gone. Its message is kept
   (dtr_comm_last_error) and logged; the group is neither broken nor aborted. */
static int dtr__p2p_isolated(dtr_comm *c, const dtr__coll *a, dtr_result r, const dtr_transport_error *e) {
    char msg[sizeof c->msg];
    if (r != DTR_PEER_FAILED || !c->ep->isolate || c->ep->vt->peer_alive(c->ep->state, c->ranks[a->root])) return 0;
    snprintf(msg, sizeof msg, "rank %d/%d %s (%zu bytes, %s rank %d, tag %d): %s", c->rank, c->size, dtr__coll_name(a->kind),
             a->count, a->kind == DTR__OP_SEND ? "to" : "from", a->root, a->tag, e->msg[0] ? e->msg : "the peer is gone");
    pthread_mutex_lock(&c->mu);
    if (c->status == DTR_OK) memcpy(c->msg, msg, sizeof msg);
    pthread_mutex_unlock(&c->mu);
    if (c->log && c->log_level >= DTR_LOG_WARN) c->log(c->log_user, DTR_LOG_WARN, msg);
    return 1;
}

static dtr_result dtr__p2p_finish(dtr_request *q, dtr_result r, const dtr_transport_error *e, int timed_out) {
    dtr_comm *c = q->comm;
    c->ep->vt->release(c->ep->state, q->treq);
    q->treq = NULL;
    q->state = DTR__REQ_DONE;
    dtr__flight_end(c, q->flight_id, r);
    if (r == DTR_OK || dtr__p2p_isolated(c, &q->a, r, e)) q->result = r;
    else if (timed_out)
        q->result = dtr__comm_fail(c, &q->a, r, e->rank, e->native_code, "timed out after %d ms: %s", q->a.timeout_ms, e->msg);
    else
        q->result = dtr__comm_fail(c, &q->a, r, e->rank, e->native_code, "%s", e->msg[0] ? e->msg : dtr_result_string(r));
    q->result = dtr__stage_out(c, &q->a, &q->st, q->result);   /* a staged receive lands on the device */
    return q->result;
}

dtr_result dtr_request_test(dtr_request *q, int *done) {
    dtr_comm *c;
    dtr_result r;
    if (!q || !done) return DTR_NULL_HANDLE;
    c = q->comm;
    *done = 0;
    if (q->treq) { /* send/recv */
        dtr_transport_error e;
        dtr__terr_clear(&e);
        if (c->ep->vt->progress) c->ep->vt->progress(c->ep->state);
        r = c->ep->vt->test(c->ep->state, q->treq, done, &e);
        if (*done || r != DTR_OK) { *done = 1; return dtr__p2p_finish(q, r, &e, 0); }
        if (dtr_time_ns() >= q->a.deadline) {
            e.rank = c->ranks[q->a.root];
            snprintf(e.msg, sizeof(e.msg), "no matching %s from rank %d", q->a.kind == DTR__OP_SEND ? "receive" : "send",
                     e.rank);
            *done = 1;
            return dtr__p2p_finish(q, DTR_TIMEOUT, &e, 1);
        }
        return DTR_OK;
    }
    pthread_mutex_lock(&c->mu);
    *done = q->state == DTR__REQ_DONE;
    pthread_mutex_unlock(&c->mu);
    if (!*done) return DTR_OK;
    dtr__req_settle(q);
    return q->result;
}

dtr_result dtr_request_wait(dtr_request *q) {
    dtr_comm *c;
    dtr_result r;
    if (!q) return DTR_NULL_HANDLE;
    c = q->comm;
    if (q->treq) {
        dtr_transport_error e;
        for (;;) {
            int done = 0;
            dtr__terr_clear(&e);
            r = c->ep->vt->test(c->ep->state, q->treq, &done, &e);
            if (done || r != DTR_OK) return dtr__p2p_finish(q, r, &e, 0);
            r = c->ep->vt->wait_any(c->ep->state, &q->treq, 1, q->a.deadline, &e);
            if (r != DTR_OK) return dtr__p2p_finish(q, r, &e, r == DTR_TIMEOUT);
        }
    }
    pthread_mutex_lock(&c->mu);
    /* the request is next and nothing runs: run it on this thread rather than wake the
       progress thread and sleep (one hand-over less; the order is the same) */
    if (q->state == DTR__REQ_QUEUED && c->head == q && !c->running) dtr__comm_run_head(c);
    /* the progress thread ends every operation by its deadline; the grace covers a
       transport that overruns, so that this call cannot hang either */
    while (q->state != DTR__REQ_DONE) {
        int64_t limit = q->a.deadline + (int64_t)2000 * 1000000;
        if (dtr__cond_wait_until(&c->done_cv, &c->mu, limit) && q->state != DTR__REQ_DONE) {
            pthread_mutex_unlock(&c->mu);
            dtr__comm_fail(c, &q->a, DTR_TIMEOUT, -1, 0, "the transport did not end the operation by its deadline");
            dtr_comm_abort(c, "an operation overran its deadline");
            pthread_mutex_lock(&c->mu);
            while (q->state != DTR__REQ_DONE) dtr__cond_wait_until(&c->done_cv, &c->mu, -1);
        }
    }
    pthread_mutex_unlock(&c->mu);
    dtr__req_settle(q);
    return q->result;
}

/* dtr_request_wait_any: checks the requests; *index = the first complete one (-1: none), the
   transport's handles of the pending ones in tr[0..*k), and the earliest of their deadlines */
static void dtr__wait_any_scan(dtr_request *const *reqs, int n, int *index, void **tr, int *k, int64_t *dl) {
    int i, done;
    *index = -1, *k = 0;
    for (i = 0; i < n; i++) {
        dtr_request *q = reqs[i];
        if (!q) continue;
        if (dtr_request_test(q, &done), done) { *index = i; return; }
        tr[(*k)++] = q->treq;
        if (q->a.deadline < *dl) *dl = q->a.deadline;
    }
}

dtr_result dtr_request_wait_any(dtr_request *const *reqs, int n, int timeout_ms, int *index) {
    void *tr[1024];
    dtr_comm *c = NULL;
    int64_t until;
    int i, k;
    if (!reqs || !index) return DTR_NULL_HANDLE;
    *index = -1;
    if (n < 1 || n > 1024 || timeout_ms < 0) return DTR_INVALID_ARGUMENT;
    for (i = 0; i < n; i++) {
        if (!reqs[i]) continue;
        if (c && reqs[i]->comm != c) return DTR_INVALID_ARGUMENT;
        c = reqs[i]->comm;
        if (reqs[i]->a.kind != DTR__OP_SEND && reqs[i]->a.kind != DTR__OP_RECV) return DTR_INVALID_ARGUMENT;   /* a collective's */
    }
    until = dtr_time_ns() + (int64_t)timeout_ms * 1000000;
    for (;;) {
        int64_t dl = until;
        dtr__wait_any_scan(reqs, n, index, tr, &k, &dl);
        if (*index >= 0 || k == 0 || dtr_time_ns() >= until) return DTR_OK;
        if (c->ep->vt->wait_some) {   /* a request's own deadline wakes it too: its test ends it */
            dtr_result r = c->ep->vt->wait_some(c->ep->state, tr, k, dl);
            if (r != DTR_OK) return r;
        } else {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
        }
    }
}

void dtr_request_destroy(dtr_request *q) {
    dtr_comm *c;
    if (!q) return;
    c = q->comm;
    if (q->treq) { /* a pending send/recv is cancelled */
        dtr__flight_end(c, q->flight_id, DTR_BAD_STATE);   /* destroyed before it finished */
        c->ep->vt->release(c->ep->state, q->treq);
        q->treq = NULL;
        dtr__stage_out(c, &q->a, &q->st, DTR_BAD_STATE);   /* its block back, nothing copied */
    } else {
        if (q->state != DTR__REQ_DONE) dtr_request_wait(q);
        dtr__req_settle(q);   /* a completed one's staged result to its destination */
    }
    pthread_mutex_lock(&c->mu);
    q->next = c->free_reqs;
    c->free_reqs = q;
    c->live_reqs--;
    pthread_mutex_unlock(&c->mu);
}

/* ---- public collectives ---- */

static dtr__coll dtr__coll_make(int kind, const void *src, void *dst, size_t count, dtr_dtype dt, dtr_reduce_op op,
                                int root) {
    dtr__coll a;
    memset(&a, 0, sizeof(a));
    a.kind = kind;
    a.src = src;
    a.dst = dst;
    a.count = count;
    a.dtype = dt;
    a.op = op;
    a.root = root;
    return a;
}

dtr_result dtr_comm_all_reduce(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt, dtr_reduce_op op) {
    dtr__coll a = dtr__coll_make(DTR__OP_ALL_REDUCE, src, dst, count, dt, op, 0);
    return dtr__coll_blocking(c, &a);
}
dtr_result dtr_comm_broadcast(dtr_comm *c, void *buf, size_t count, dtr_dtype dt, int root) {
    dtr__coll a = dtr__coll_make(DTR__OP_BROADCAST, buf, buf, count, dt, DTR_REDUCE_SUM, root);
    return dtr__coll_blocking(c, &a);
}
dtr_result dtr_comm_reduce_scatter(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                   dtr_reduce_op op) {
    dtr__coll a = dtr__coll_make(DTR__OP_REDUCE_SCATTER, src, dst, count, dt, op, 0);
    return dtr__coll_blocking(c, &a);
}

dtr_result dtr__comm_sum_doubles(dtr_comm *c, dtr_context *ctx, double *vals, int n, const char *who) {
    int W = dtr_comm_size(c), i, r;
    double *all = (double *)dtr__malloc(&ctx->alloc, (size_t)(W * (n > 0 ? n : 1)) * sizeof(double));
    dtr_result res;
    if (!all) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "%s: out of memory", who);
    res = dtr_comm_all_gather(c, vals, all, (size_t)n * sizeof(double), DTR_U8);
    for (i = 0; i < n && res == DTR_OK; i++) {
        vals[i] = 0.0;
        for (r = 0; r < W; r++) vals[i] += all[r * n + i];
    }
    dtr__free(&ctx->alloc, all);
    if (res != DTR_OK) return dtr__fail(ctx, res, "%s: summing over the group: %s", who, dtr_comm_last_error(c));
    return DTR_OK;
}

dtr_result dtr_comm_all_gather(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt) {
    dtr__coll a = dtr__coll_make(DTR__OP_ALL_GATHER, src, dst, count, dt, DTR_REDUCE_SUM, 0);
    return dtr__coll_blocking(c, &a);
}
dtr_result dtr_comm_barrier(dtr_comm *c) {
    dtr__coll a = dtr__coll_make(DTR__OP_BARRIER, NULL, NULL, 0, DTR_U8, DTR_REDUCE_SUM, 0);
    return dtr__coll_blocking(c, &a);
}
dtr_result dtr_comm_all_reduce_async(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                     dtr_reduce_op op, dtr_request **req) {
    dtr__coll a = dtr__coll_make(DTR__OP_ALL_REDUCE, src, dst, count, dt, op, 0);
    return dtr__coll_async(c, &a, req);
}
dtr_result dtr_comm_broadcast_async(dtr_comm *c, void *buf, size_t count, dtr_dtype dt, int root, dtr_request **req) {
    dtr__coll a = dtr__coll_make(DTR__OP_BROADCAST, buf, buf, count, dt, DTR_REDUCE_SUM, root);
    return dtr__coll_async(c, &a, req);
}
dtr_result dtr_comm_reduce_scatter_async(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                         dtr_reduce_op op, dtr_request **req) {
    dtr__coll a = dtr__coll_make(DTR__OP_REDUCE_SCATTER, src, dst, count, dt, op, 0);
    return dtr__coll_async(c, &a, req);
}
dtr_result dtr_comm_all_gather_async(dtr_comm *c, const void *src, void *dst, size_t count, dtr_dtype dt,
                                     dtr_request **req) {
    dtr__coll a = dtr__coll_make(DTR__OP_ALL_GATHER, src, dst, count, dt, DTR_REDUCE_SUM, 0);
    return dtr__coll_async(c, &a, req);
}
dtr_result dtr_comm_barrier_async(dtr_comm *c, dtr_request **req) {
    dtr__coll a = dtr__coll_make(DTR__OP_BARRIER, NULL, NULL, 0, DTR_U8, DTR_REDUCE_SUM, 0);
    return dtr__coll_async(c, &a, req);
}

/* ---- point-to-point ---- */

static dtr_result dtr__p2p_start(dtr_comm *c, int kind, const void *sbuf, void *rbuf, size_t bytes, int peer, int tag,
                                 dtr_request **out) {
    dtr__coll a = dtr__coll_make(kind, sbuf, rbuf, bytes, DTR_U8, DTR_REDUCE_SUM, peer);
    dtr_transport_error e;
    dtr_request *q;
    dtr_result r;
    *out = NULL;
    a.tag = tag;
    r = dtr__coll_prepare(c, &a);
    if (r != DTR_OK) return r;
    q = dtr__req_get(c);
    if (!q) return dtr__comm_fail(c, &a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory");
    if ((r = dtr__stage_in(c, &a, &q->st)) != DTR_OK) {   /* a device buffer's host image */
        dtr__req_put(c, q);
        return r;
    }
    q->a = a;
    q->state = DTR__REQ_RUNNING;
    q->flight_id = dtr__flight_begin(c, &a);
    dtr__terr_clear(&e);
    if (kind == DTR__OP_SEND)
        r = c->ep->vt->isend(c->ep->state, a.src, bytes, c->ranks[peer], dtr__tag_p2p(c->ctx, tag), &q->treq, &e);
    else
        r = c->ep->vt->irecv(c->ep->state, a.dst, bytes, c->ranks[peer], dtr__tag_p2p(c->ctx, tag), &q->treq, &e);
    if (r != DTR_OK) {
        dtr__flight_end(c, q->flight_id, r);
        dtr__stage_out(c, &a, &q->st, r);
        dtr__req_put(c, q);
        if (dtr__p2p_isolated(c, &a, r, &e)) return r;
        return dtr__comm_fail(c, &a, r, e.rank, e.native_code, "%s", e.msg);
    }
    pthread_mutex_lock(&c->mu);
    c->live_reqs++;
    pthread_mutex_unlock(&c->mu);
    *out = q;
    return DTR_OK;
}

dtr_result dtr_comm_send_async(dtr_comm *c, const void *buf, size_t bytes, int dst, int tag, dtr_request **req) {
    if (!req) return DTR_NULL_HANDLE;
    return dtr__p2p_start(c, DTR__OP_SEND, buf, NULL, bytes, dst, tag, req);
}
dtr_result dtr_comm_recv_async(dtr_comm *c, void *buf, size_t bytes, int src, int tag, dtr_request **req) {
    if (!req) return DTR_NULL_HANDLE;
    return dtr__p2p_start(c, DTR__OP_RECV, NULL, buf, bytes, src, tag, req);
}
dtr_result dtr_comm_send(dtr_comm *c, const void *buf, size_t bytes, int dst, int tag) {
    dtr_request *q;
    dtr_result r = dtr__p2p_start(c, DTR__OP_SEND, buf, NULL, bytes, dst, tag, &q);
    if (r != DTR_OK) return r;
    r = dtr_request_wait(q);
    dtr_request_destroy(q);
    return r;
}
dtr_result dtr_comm_recv(dtr_comm *c, void *buf, size_t bytes, int src, int tag) {
    dtr_request *q;
    dtr_result r = dtr__p2p_start(c, DTR__OP_RECV, NULL, buf, bytes, src, tag, &q);
    if (r != DTR_OK) return r;
    r = dtr_request_wait(q);
    dtr_request_destroy(q);
    return r;
}

/* ---- split ---- */

dtr_result dtr_comm_split(dtr_comm *c, int color, int key, dtr_comm **out) {
    dtr__coll a;
    int32_t mine[4], *all;
    dtr_comm *nc = NULL;
    dtr_result r;
    uint32_t ctx = 0;
    int i, n = 0, me = -1;
    if (!c || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    a = dtr__coll_make(DTR__OP_SPLIT, NULL, NULL, 4, DTR_I32, DTR_REDUCE_SUM, 0);
    if (color < DTR_COMM_UNDEFINED) return dtr__comm_fail(c, &a, DTR_INVALID_ARGUMENT, -1, 0, "color %d < -1", color);
    all = (int32_t *)dtr__malloc(&c->ep->alloc, (size_t)c->size * sizeof(mine));
    if (!all) return dtr__comm_fail(c, &a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory");
    pthread_mutex_lock(&c->ep->mu);
    mine[0] = color;
    mine[1] = key;
    mine[2] = (int32_t)c->ep->next_ctx;
    mine[3] = c->ep->info.rank - c->ep->info.local_rank; /* the machine: its first rank (ranks of a machine are contiguous) */
    pthread_mutex_unlock(&c->ep->mu);
    r = dtr_comm_all_gather(c, mine, all, 4, DTR_I32);
    if (r != DTR_OK) goto done;
    /* one context id for every sub-group of this split (they are disjoint): the largest
       "next free" id among the ranks of c, so no rank of c uses it yet */
    for (i = 0; i < c->size; i++)
        if ((uint32_t)all[4 * i + 2] > ctx) ctx = (uint32_t)all[4 * i + 2];
    if (ctx > DTR__MAX_CTX) {
        r = dtr__comm_fail(c, &a, DTR_UNSUPPORTED, -1, 0, "all %u context ids are used", DTR__MAX_CTX);
        goto done;
    }
    pthread_mutex_lock(&c->ep->mu);
    if (c->ep->next_ctx <= ctx) c->ep->next_ctx = ctx + 1;
    pthread_mutex_unlock(&c->ep->mu);
    if (color == DTR_COMM_UNDEFINED) goto done;
    for (i = 0; i < c->size; i++) n += all[4 * i] == color;
    r = dtr__comm_new(c->ep, n, &nc);
    if (r != DTR_OK) { r = dtr__comm_fail(c, &a, r, -1, 0, "out of memory"); goto done; }
    /* members ordered by (key, rank in c): insertion sort, n is small */
    n = 0;
    for (i = 0; i < c->size; i++) {
        int j;
        if (all[4 * i] != color) continue;
        for (j = n; j > 0 && all[4 * nc->ranks[j - 1] + 1] > all[4 * i + 1]; j--) nc->ranks[j] = nc->ranks[j - 1];
        nc->ranks[j] = i;
        n++;
    }
    for (i = 0; i < n; i++) {
        if (nc->ranks[i] == c->rank) me = i;
        nc->ranks[i] = c->ranks[nc->ranks[i]];   /* to transport ranks */
    }
    nc->rank = me;
    nc->ctx = ctx;
    nc->mem_ctx = c->mem_ctx;
    nc->stage_ctx = c->stage_ctx;
    nc->stage_to_dev = c->stage_to_dev;
    nc->timeout_ms = c->timeout_ms;
    nc->algo = c->algo;
    nc->ring_threshold = c->ring_threshold;
    nc->chain_threshold = c->chain_threshold;
    nc->segment = c->segment;
    nc->no_native = c->no_native;
    nc->shm_wanted = c->shm_wanted;
    nc->log = c->log;
    nc->log_user = c->log_user;
    nc->log_level = c->log_level;
    if ((r = dtr__flight_init(nc, c->flight.cap ? c->flight.cap : -1, c->flight.dir)) != DTR_OK) {
        dtr_comm_destroy(nc);
        r = dtr__comm_fail(c, &a, r, -1, 0, "out of memory");
        goto done;
    }
    /* local rank: among the members on this machine, in group order */
    nc->local_rank = nc->local_size = 0;
    for (i = 0; i < n; i++) {
        int j;
        for (j = 0; j < c->size; j++)
            if (c->ranks[j] == nc->ranks[i]) break;
        if (all[4 * j + 3] != mine[3]) continue;
        if (i < me) nc->local_rank++;
        nc->local_size++;
    }
    if (c->ep->vt->group_create && !nc->no_native) {
        if (c->ep->vt->group_create(c->ep->state, nc->ranks, nc->size, nc->ctx, &nc->native_group) != DTR_OK)
            nc->native_group = NULL;
    }
    if (!nc->native_group && (r = dtr__shm_setup(nc)) != DTR_OK) {
        r = dtr__comm_fail(c, &a, r, dtr_comm_failed_rank(nc), 0, "setting up the sub-group: %s", nc->msg);
        dtr_comm_destroy(nc);
        goto done;
    }
    *out = nc;
done:
    dtr__free(&c->ep->alloc, all);
    return r;
}
