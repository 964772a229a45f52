/* ============================================================================
 * The NCCL transport (in dtrain_comm.c when nccl.h is found: DTR_USE_NCCL; link -lnccl
 * -lcudart). One process per GPU: rank and size come from the rendezvous store, rank 0's
 * ncclUniqueId goes to the others through it, and each rank opens a non-blocking
 * communicator on its device (cfg->nccl.device, else its local rank). Buffers are device
 * memory (mem_kinds DTR_MEM_DEVICE).
 *
 * Every operation is queued on the transport's stream after the work queued so far on
 * cfg->context's stream (an event of the CUDA backend: its dtr_event is a cudaEvent_t), and
 * waited for by polling its event and ncclCommGetAsyncError with naps: never a spin, and
 * never past the deadline. A deadline that passes, an asynchronous error or a peer process of
 * this host that is gone aborts the communicator (ncclCommAbort: NCCL itself would wait
 * forever) and fails every later operation with DTR_PEER_FAILED naming the rank.
 *
 * Point-to-point: NCCL has no tags and matches the sends and receives of a pair of ranks in
 * the order they are posted, with equal sizes. isend/irecv queue the operation; the next
 * test or wait issues everything queued in one ncclGroupStart/End, so exchanges (both ranks
 * send, then receive) cannot deadlock. Collectives with a native NCCL call (all-reduce,
 * broadcast, reduce-scatter, all-gather, barrier) go straight to it; a group of a subset of
 * ranks gets a communicator of its own (its unique id through the store).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_rdzv.h"
#include "../public/api_comm.h"
#include "../core/internal.h"
#include "../comm/comm_internal.h"
#include "nccl_watch.h"

#if defined(DTR_USE_NCCL) && !defined(_WIN32)
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <pthread.h>
#include <time.h>

#define DTR__NCCL_QUEUE 64          /* point-to-point operations queued before a flush */
#define DTR__NCCL_MAX_NAP 100000    /* ns */

typedef struct dtr__nccl_req {
    cudaEvent_t ev;
    int peer, is_recv, issued;
    void *buf;
    size_t bytes;
} dtr__nccl_req;

typedef struct dtr__nccl {
    dtr__boot boot;
    ncclComm_t comm;
    cudaStream_t stream;
    dtr_context *ctx;                /* cfg->context: its stream's work goes first */
    int device, rank, size;
    int64_t timeout_ns;
    pthread_mutex_t mu;              /* NCCL calls on one communicator are serialised */
    dtr__nccl_req *queue[DTR__NCCL_QUEUE];
    int queued;
    int aborted, failed_rank;
    char why[160];
    dtr_allocation_callbacks alloc;
} dtr__nccl;

typedef struct dtr__nccl_group {
    ncclComm_t comm;                 /* the world's, or a communicator of the subset */
    int own;                         /* 1: this group made `comm` */
    int *ranks, n;                   /* transport ranks of the group, in group order */
} dtr__nccl_group;

static void dtr__nccl_err(dtr_transport_error *err, int rank, int code, const char *fmt, const char *what) {
    if (!err) return;
    err->rank = rank;
    err->native_code = code;
    snprintf(err->msg, sizeof err->msg, fmt, what);
}

static void dtr__nccl_sleep(int64_t ns) {
    struct timespec ts;
    if (ns <= 0) return;
    ts.tv_sec = (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    nanosleep(&ts, NULL);
}

/* ---- failure ---- */

/* Marks the world failed and aborts the communicator (lock held). */
static void dtr__nccl_fail_locked(dtr__nccl *t, int rank, const char *why) {
    if (t->aborted) return;
    t->aborted = 1;
    t->failed_rank = rank;
    snprintf(t->why, sizeof t->why, "%s", why);
    if (t->comm) ncclCommAbort(t->comm);
    t->comm = NULL;
}

static void dtr__nccl_abort(void *state, int failed_rank, const char *why) {
    dtr__nccl *t = (dtr__nccl *)state;
    pthread_mutex_lock(&t->mu);
    dtr__nccl_fail_locked(t, failed_rank, why ? why : "aborted");
    pthread_mutex_unlock(&t->mu);
}

/* A peer process of this host that is gone, or -1. */
static int dtr__nccl_dead_peer(const dtr__nccl *t) {
    int p;
    for (p = 0; p < t->size; p++)
        if (p != t->rank && t->boot.on_host[p] && dtr__pid_dead(t->boot.pids[p])) return p;
    return -1;
}

/* 0 no error, 1 in progress, 2 error (dtr__nccl_watch's scale). */
static int dtr__nccl_async(ncclComm_t comm) {
    ncclResult_t st = ncclSuccess;
    if (!comm) return 2;
    if (ncclCommGetAsyncError(comm, &st) != ncclSuccess) return 2;
    return st == ncclSuccess ? 0 : st == ncclInProgress ? 1 : 2;
}

/* ---- waiting ---- */

/* Waits for `ev` (NULL: for the communicator to be ready) until the deadline: polls, naps,
 * and aborts on an error, a dead peer or the deadline. `peer`: whom to blame on a timeout. */
static dtr_result dtr__nccl_wait_event(dtr__nccl *t, cudaEvent_t ev, ncclComm_t comm, int peer, int64_t deadline_ns,
                                       dtr_transport_error *err) {
    int64_t nap = 0;
    int polls = 0;
    for (;;) {
        int64_t now = dtr_time_ns();
        int done, async, dead = -1;
        dtr__nccl_next next;
        pthread_mutex_lock(&t->mu);
        if (t->aborted) {
            pthread_mutex_unlock(&t->mu);
            dtr__nccl_err(err, t->failed_rank, 0, "%s", t->why);
            return DTR_PEER_FAILED;
        }
        async = dtr__nccl_async(comm);
        done = ev ? cudaEventQuery(ev) == cudaSuccess : async == 0;
        if (!done && (++polls & 7) == 0) dead = dtr__nccl_dead_peer(t);
        next = dtr__nccl_watch(done, async, dead, now, deadline_ns);
        if (next == DTR__NCCL_ERROR) dtr__nccl_fail_locked(t, peer, "NCCL reported an asynchronous error");
        if (next == DTR__NCCL_PEER_DEAD) dtr__nccl_fail_locked(t, dead, "the process of this rank is gone");
        if (next == DTR__NCCL_TIMEOUT) dtr__nccl_fail_locked(t, peer, "did not take part before the deadline");
        pthread_mutex_unlock(&t->mu);
        if (next == DTR__NCCL_DONE) return DTR_OK;
        if (next != DTR__NCCL_WAIT) {
            dtr__nccl_err(err, next == DTR__NCCL_PEER_DEAD ? dead : peer, 0, "%s", t->why);
            return next == DTR__NCCL_TIMEOUT ? DTR_TIMEOUT : DTR_PEER_FAILED;
        }
        nap = dtr__nccl_nap(nap, DTR__NCCL_MAX_NAP, now, deadline_ns);
        dtr__nccl_sleep(nap);
    }
}

/* The transport's stream waits for the work queued so far on the context's stream. */
static dtr_result dtr__nccl_after_context(dtr__nccl *t) {
    dtr_event *ev = NULL;
    if (!t->ctx || !t->ctx->backend->event_record) return DTR_OK;
    if (t->ctx->backend->event_record(t->ctx, &ev) != DTR_OK) return t->ctx->status;
    if (ev && cudaStreamWaitEvent(t->stream, *(cudaEvent_t *)ev, 0) != cudaSuccess) return DTR_DEVICE_ERROR;
    return DTR_OK;
}

/* ---- open and close ---- */

static void dtr__nccl_free(dtr__nccl *t) {
    int i;
    for (i = 0; i < t->queued; i++) {
        cudaEventDestroy(t->queue[i]->ev);
        dtr__free(&t->alloc, t->queue[i]);
    }
    if (t->comm) {
        ncclCommFinalize(t->comm);
        ncclCommDestroy(t->comm);
    }
    if (t->stream) cudaStreamDestroy(t->stream);
    dtr__boot_close(&t->boot);
    pthread_mutex_destroy(&t->mu);
    dtr__free(&t->alloc, t);
}

static void dtr__nccl_close(void *state) {
    if (state) dtr__nccl_free((dtr__nccl *)state);
}

/* Opens a communicator of `n` ranks (this one being `rank`) from the id at store key `what`,
 * made by the group's first rank; waits for it with the deadline. */
static dtr_result dtr__nccl_comm_open(dtr__nccl *t, const char *what, int first, int rank, int n, ncclComm_t *out, char *err,
                                      size_t errlen) {
    ncclUniqueId id;
    ncclConfig_t conf = NCCL_CONFIG_INITIALIZER;
    size_t len = 0;
    dtr_result r;
    if (rank == 0) {
        if (ncclGetUniqueId(&id) != ncclSuccess) return dtr__errf(err, errlen, DTR_DEVICE_ERROR, "nccl: ncclGetUniqueId failed");
        if ((r = dtr__boot_publish(&t->boot, what, &id, sizeof id)) != DTR_OK) return dtr__boot_fail(&t->boot, r, what, err, errlen);
    } else if ((r = dtr__boot_fetch(&t->boot, what, first, &id, sizeof id, &len)) != DTR_OK || len != sizeof id) {
        return dtr__boot_fail(&t->boot, r != DTR_OK ? r : DTR_CORRUPT_FILE, what, err, errlen);
    }
    conf.blocking = 0;   /* deadlines work: init returns at once and is polled */
    if (ncclCommInitRankConfig(out, n, id, rank, &conf) != ncclSuccess && *out == NULL)
        return dtr__errf(err, errlen, DTR_DEVICE_ERROR, "nccl: ncclCommInitRankConfig failed");
    if ((r = dtr__nccl_wait_event(t, NULL, *out, first, dtr_time_ns() + t->timeout_ns, NULL)) != DTR_OK)
        return dtr__errf(err, errlen, r, "nccl: the communicator of %d ranks did not form before the deadline (%s)", n, t->why);
    return DTR_OK;
}

static dtr_result dtr__nccl_open(const dtr_comm_config *cfg, void **state, dtr_transport_info *info, char *err, size_t errlen) {
    dtr__nccl *t;
    dtr_result r;
    int ndev = 0;
    *state = NULL;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        (void)cudaGetLastError();
        return dtr__errf(err, errlen, DTR_UNSUPPORTED, "nccl: no CUDA device is visible to this process");
    }
    t = (dtr__nccl *)dtr__calloc(&cfg->alloc, sizeof *t);
    if (!t) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "nccl: out of memory");
    t->alloc = cfg->alloc;
    t->failed_rank = -1;
    t->ctx = cfg->context;
    t->timeout_ns = (int64_t)(cfg->timeout_ms > 0 ? cfg->timeout_ms : 300000) * 1000000;
    pthread_mutex_init(&t->mu, NULL);
    if ((r = dtr__boot_open(&t->boot, cfg, "nccl", "dtrnccl", err, errlen)) != DTR_OK) {
        dtr__nccl_free(t);
        return r;
    }
    t->rank = t->boot.rank;
    t->size = t->boot.size;
    t->device = cfg->nccl.device >= 0 ? cfg->nccl.device : t->boot.local_rank % ndev;
    if (cudaSetDevice(t->device) != cudaSuccess || cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking) != cudaSuccess) {
        dtr__nccl_free(t);
        return dtr__errf(err, errlen, DTR_DEVICE_ERROR, "nccl: rank %d: cannot use CUDA device %d", t->boot.rank, t->device);
    }
    if ((r = dtr__nccl_comm_open(t, "id", 0, t->rank, t->size, &t->comm, err, errlen)) != DTR_OK) {
        dtr__nccl_free(t);
        return r;
    }
    info->rank = t->rank;
    info->size = t->size;
    info->local_rank = t->boot.local_rank;
    info->local_size = t->boot.local_size;
    snprintf(info->detail, sizeof info->detail, "NCCL %d.%d, device %d", NCCL_MAJOR, NCCL_MINOR, t->device);
    *state = t;
    return DTR_OK;
}

/* ---- point-to-point: queued, then issued together ---- */

static dtr_result dtr__nccl_post(dtr__nccl *t, void *buf, size_t bytes, int peer, int is_recv, void **req,
                                 dtr_transport_error *err) {
    dtr__nccl_req *q;
    if (peer < 0 || peer >= t->size) {
        dtr__nccl_err(err, -1, 0, "%s", "peer rank out of range");
        return DTR_INVALID_ARGUMENT;
    }
    q = (dtr__nccl_req *)dtr__calloc(&t->alloc, sizeof *q);
    if (!q || cudaEventCreateWithFlags(&q->ev, cudaEventDisableTiming) != cudaSuccess) {
        dtr__free(&t->alloc, q);
        dtr__nccl_err(err, -1, 0, "%s", "out of memory for a request");
        return DTR_OUT_OF_MEMORY;
    }
    q->peer = peer;
    q->is_recv = is_recv;
    q->buf = buf;
    q->bytes = bytes;
    pthread_mutex_lock(&t->mu);
    if (t->queued == DTR__NCCL_QUEUE) {
        pthread_mutex_unlock(&t->mu);
        cudaEventDestroy(q->ev);
        dtr__free(&t->alloc, q);
        dtr__nccl_err(err, -1, 0, "%s", "too many point-to-point operations queued (test or wait them)");
        return DTR_BAD_STATE;
    }
    t->queue[t->queued++] = q;
    pthread_mutex_unlock(&t->mu);
    *req = q;
    return DTR_OK;
}

static dtr_result dtr__nccl_isend(void *state, const void *buf, size_t bytes, int dst, uint64_t tag, void **req,
                                  dtr_transport_error *err) {
    (void)tag;
    return dtr__nccl_post((dtr__nccl *)state, (void *)buf, bytes, dst, 0, req, err);
}

static dtr_result dtr__nccl_irecv(void *state, void *buf, size_t bytes, int src, uint64_t tag, void **req,
                                  dtr_transport_error *err) {
    (void)tag;
    return dtr__nccl_post((dtr__nccl *)state, buf, bytes, src, 1, req, err);
}

/* Issues every queued operation in one NCCL group, each followed by its event (lock held). */
static dtr_result dtr__nccl_flush_locked(dtr__nccl *t) {
    int i, n = t->queued;
    ncclResult_t st;
    if (n == 0 || t->aborted) return t->aborted ? DTR_PEER_FAILED : DTR_OK;
    t->queued = 0;
    if (dtr__nccl_after_context(t) != DTR_OK) return DTR_DEVICE_ERROR;
    ncclGroupStart();
    for (i = 0; i < n; i++) {
        dtr__nccl_req *q = t->queue[i];
        if (q->is_recv) ncclRecv(q->buf, q->bytes, ncclUint8, q->peer, t->comm, t->stream);
        else ncclSend(q->buf, q->bytes, ncclUint8, q->peer, t->comm, t->stream);
    }
    st = ncclGroupEnd();
    if (st != ncclSuccess && st != ncclInProgress) {
        dtr__nccl_fail_locked(t, t->queue[0]->peer, "ncclGroupEnd failed");
        return DTR_PEER_FAILED;
    }
    for (i = 0; i < n; i++) {
        cudaEventRecord(t->queue[i]->ev, t->stream);
        t->queue[i]->issued = 1;
    }
    return DTR_OK;
}

static dtr_result dtr__nccl_test(void *state, void *req, int *done, dtr_transport_error *err) {
    dtr__nccl *t = (dtr__nccl *)state;
    dtr__nccl_req *q = (dtr__nccl_req *)req;
    dtr_result r;
    *done = 0;
    pthread_mutex_lock(&t->mu);
    r = dtr__nccl_flush_locked(t);
    if (r == DTR_OK && q->issued) *done = cudaEventQuery(q->ev) == cudaSuccess;
    if (t->aborted) { *done = 1; r = DTR_PEER_FAILED; dtr__nccl_err(err, t->failed_rank, 0, "%s", t->why); }
    pthread_mutex_unlock(&t->mu);
    return r;
}

static dtr_result dtr__nccl_wait_any(void *state, void *const *reqs, int n, int64_t deadline_ns, dtr_transport_error *err) {
    dtr__nccl *t = (dtr__nccl *)state;
    int64_t nap = 0;
    for (;;) {
        int i, pending = -1, done;
        dtr_result r;
        for (i = 0; i < n; i++) {
            if (!reqs[i]) continue;
            if ((r = dtr__nccl_test(t, reqs[i], &done, err)) != DTR_OK) return r;
            if (done) return DTR_OK;
            if (pending < 0) pending = i;
        }
        if (pending < 0) return DTR_OK;
        {
            const dtr__nccl_req *q = (const dtr__nccl_req *)reqs[pending];
            int64_t now = dtr_time_ns();
            int dead = dtr__nccl_dead_peer(t);
            dtr__nccl_next next = dtr__nccl_watch(0, dtr__nccl_async(t->comm), dead, now, deadline_ns);
            if (next != DTR__NCCL_WAIT) {
                pthread_mutex_lock(&t->mu);
                dtr__nccl_fail_locked(t, next == DTR__NCCL_PEER_DEAD ? dead : q->peer,
                                      next == DTR__NCCL_TIMEOUT ? "did not take part before the deadline" : "failed");
                pthread_mutex_unlock(&t->mu);
                dtr__nccl_err(err, next == DTR__NCCL_PEER_DEAD ? dead : q->peer, 0, "%s", t->why);
                return next == DTR__NCCL_TIMEOUT ? DTR_TIMEOUT : DTR_PEER_FAILED;
            }
            nap = dtr__nccl_nap(nap, DTR__NCCL_MAX_NAP, now, deadline_ns);
            dtr__nccl_sleep(nap);
        }
    }
}

static void dtr__nccl_release(void *state, void *req) {
    dtr__nccl *t = (dtr__nccl *)state;
    dtr__nccl_req *q = (dtr__nccl_req *)req;
    int i;
    if (!q) return;
    pthread_mutex_lock(&t->mu);
    for (i = 0; i < t->queued; i++)   /* never issued: just drop it */
        if (t->queue[i] == q) { t->queue[i] = t->queue[--t->queued]; break; }
    /* an issued operation NCCL cannot cancel: the world is aborted unless it completed */
    if (q->issued && cudaEventQuery(q->ev) != cudaSuccess) dtr__nccl_fail_locked(t, q->peer, "an operation was cancelled");
    pthread_mutex_unlock(&t->mu);
    cudaEventDestroy(q->ev);
    dtr__free(&t->alloc, q);
}

/* ---- native collectives ---- */

static dtr_result dtr__nccl_group_create(void *state, const int *ranks, int n, uint32_t context_id, void **group) {
    dtr__nccl *t = (dtr__nccl *)state;
    dtr__nccl_group *g = (dtr__nccl_group *)dtr__calloc(&t->alloc, sizeof *g);
    int i, me = -1;
    char what[48], err[160];
    if (!g) return DTR_OUT_OF_MEMORY;
    g->ranks = (int *)dtr__calloc(&t->alloc, sizeof(int) * (size_t)(n > 0 ? n : 1));
    if (!g->ranks) { dtr__free(&t->alloc, g); return DTR_OUT_OF_MEMORY; }
    for (i = 0; i < n; i++) { g->ranks[i] = ranks[i]; if (ranks[i] == t->rank) me = i; }
    g->n = n;
    if (n == t->size && me == t->rank) {
        g->comm = t->comm;   /* the whole world, in order: its communicator */
    } else {
        dtr_result r;
        snprintf(what, sizeof what, "group%u", (unsigned)context_id);
        r = me < 0 ? DTR_INVALID_ARGUMENT : dtr__nccl_comm_open(t, what, ranks[0], me, n, &g->comm, err, sizeof err);
        if (r != DTR_OK) { dtr__free(&t->alloc, g->ranks); dtr__free(&t->alloc, g); return r; }
        g->own = 1;
    }
    *group = g;
    return DTR_OK;
}

static void dtr__nccl_group_destroy(void *state, void *group) {
    dtr__nccl *t = (dtr__nccl *)state;
    dtr__nccl_group *g = (dtr__nccl_group *)group;
    if (!g) return;
    if (g->own && g->comm) {
        if (t->aborted) ncclCommAbort(g->comm);
        else { ncclCommFinalize(g->comm); ncclCommDestroy(g->comm); }
    }
    dtr__free(&t->alloc, g->ranks);
    dtr__free(&t->alloc, g);
}

static int dtr__nccl_type(dtr_dtype dt, ncclDataType_t *out) {
    switch (dt) {
    case DTR_F32: *out = ncclFloat32; return 1;
    case DTR_F16: *out = ncclFloat16; return 1;
    case DTR_BF16: *out = ncclBfloat16; return 1;
    case DTR_I32: *out = ncclInt32; return 1;
    case DTR_U8: *out = ncclUint8; return 1;
    default: return 0;
    }
}

static ncclRedOp_t dtr__nccl_op(dtr_reduce_op op) { return op == DTR_REDUCE_MAX ? ncclMax : op == DTR_REDUCE_AVG ? ncclAvg : ncclSum; }

/* Issues one collective (`kind`) on the group's communicator and waits for it. */
enum { DTR__NCCL_ALLREDUCE, DTR__NCCL_BCAST, DTR__NCCL_RS, DTR__NCCL_AG };

static dtr_result dtr__nccl_collective(dtr__nccl *t, dtr__nccl_group *g, int kind, const void *src, void *dst, size_t count,
                                       dtr_dtype dt, dtr_reduce_op op, int root, int64_t deadline_ns, dtr_transport_error *err) {
    ncclDataType_t ty;
    ncclResult_t st = ncclSuccess;
    cudaEvent_t ev;
    dtr_result r;
    if (!dtr__nccl_type(dt, &ty)) {
        dtr__nccl_err(err, -1, 0, "%s", "dtype NCCL does not take");
        return DTR_DTYPE_MISMATCH;
    }
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) return DTR_DEVICE_ERROR;
    pthread_mutex_lock(&t->mu);
    r = t->aborted ? DTR_PEER_FAILED : dtr__nccl_after_context(t);
    if (r == DTR_OK) {
        switch (kind) {
        case DTR__NCCL_ALLREDUCE: st = ncclAllReduce(src, dst, count, ty, dtr__nccl_op(op), g->comm, t->stream); break;
        case DTR__NCCL_BCAST: st = ncclBroadcast(dst, dst, count, ty, root, g->comm, t->stream); break;
        case DTR__NCCL_RS: st = ncclReduceScatter(src, dst, count, ty, dtr__nccl_op(op), g->comm, t->stream); break;
        default: st = ncclAllGather(src, dst, count, ty, g->comm, t->stream); break;
        }
        if (st != ncclSuccess && st != ncclInProgress) dtr__nccl_fail_locked(t, -1, ncclGetErrorString(st));
        else cudaEventRecord(ev, t->stream);
    }
    pthread_mutex_unlock(&t->mu);
    if (r == DTR_OK && !t->aborted) r = dtr__nccl_wait_event(t, ev, g->comm, root >= 0 ? g->ranks[root] : -1, deadline_ns, err);
    else if (r == DTR_OK || r == DTR_PEER_FAILED) { dtr__nccl_err(err, t->failed_rank, 0, "%s", t->why); r = DTR_PEER_FAILED; }
    cudaEventDestroy(ev);
    return r;
}

static dtr_result dtr__nccl_all_reduce(void *state, void *group, const void *src, void *dst, size_t count, dtr_dtype dt,
                                       dtr_reduce_op op, int64_t deadline_ns, dtr_transport_error *err) {
    return dtr__nccl_collective((dtr__nccl *)state, (dtr__nccl_group *)group, DTR__NCCL_ALLREDUCE, src, dst, count, dt, op, -1,
                                deadline_ns, err);
}

static dtr_result dtr__nccl_broadcast(void *state, void *group, void *buf, size_t count, dtr_dtype dt, int root,
                                      int64_t deadline_ns, dtr_transport_error *err) {
    return dtr__nccl_collective((dtr__nccl *)state, (dtr__nccl_group *)group, DTR__NCCL_BCAST, buf, buf, count, dt,
                                DTR_REDUCE_SUM, root, deadline_ns, err);
}

static dtr_result dtr__nccl_reduce_scatter(void *state, void *group, const void *src, void *dst, size_t count, dtr_dtype dt,
                                           dtr_reduce_op op, int64_t deadline_ns, dtr_transport_error *err) {
    return dtr__nccl_collective((dtr__nccl *)state, (dtr__nccl_group *)group, DTR__NCCL_RS, src, dst, count, dt, op, -1,
                                deadline_ns, err);
}

static dtr_result dtr__nccl_all_gather(void *state, void *group, const void *src, void *dst, size_t count, dtr_dtype dt,
                                       int64_t deadline_ns, dtr_transport_error *err) {
    return dtr__nccl_collective((dtr__nccl *)state, (dtr__nccl_group *)group, DTR__NCCL_AG, src, dst, count, dt, DTR_REDUCE_SUM,
                                -1, deadline_ns, err);
}

static const dtr_transport_vtable dtr__nccl_vtable = {
    DTR_VERSION_NUMBER,
    "nccl",
    dtr__nccl_open,
    dtr__nccl_close,
    dtr__nccl_isend,
    dtr__nccl_irecv,
    dtr__nccl_test,
    dtr__nccl_wait_any,
    dtr__nccl_release,
    dtr__nccl_abort,
    NULL,
    dtr__nccl_group_create,
    dtr__nccl_group_destroy,
    dtr__nccl_all_reduce,
    dtr__nccl_broadcast,
    dtr__nccl_reduce_scatter,
    dtr__nccl_all_gather,
    NULL,   /* barrier: dtr_comm's, over point-to-point */
    DTR_MEM_DEVICE,
    NULL,   /* peer_alive: a dead peer aborts the communicator (no isolation) */
    NULL    /* wait_some: dtr_request_wait_any naps */
};

const dtr_transport_vtable *dtr_nccl_transport(void) { return &dtr__nccl_vtable; }

#else /* no NCCL in this build */

const dtr_transport_vtable *dtr_nccl_transport(void) { return NULL; }

#endif
