/* ============================================================================
 * The libfabric transport: reliable-datagram endpoints (FI_EP_RDM) with tagged messages.
 *
 * Build: cc -c dtrain_comm.c -DDTR_USE_LIBFABRIC $(pkg-config --cflags libfabric), link
 * $(pkg-config --libs libfabric). Without DTR_USE_LIBFABRIC the unit compiles to stubs:
 * dtr_fabric_transport() returns NULL and dtr_fabric_providers() DTR_UNSUPPORTED.
 *
 * Opening (every rank, through the rendezvous store; see docs/distributed.md):
 *   1. The transport joins the store a second time (dtr__store_clone) so that its address
 *      exchange and its watchdog never queue behind the application's store calls, and takes
 *      a namespace "dtrfab/<n>" from the n-th open of this rank (the n-th opens of all ranks
 *      meet there).
 *   2. Each rank publishes its host identity (boot id and pid namespace) and pid; every rank
 *      reads all of them: local rank and size follow, and peers on this host can be watched
 *      by pid.
 *   3. Rank 0 picks the provider: cfg->provider, else $DTR_FABRIC_PROVIDER, else automatic
 *      (`shm` when every rank is on this host, otherwise the first that exists of cxi, efa,
 *      verbs;ofi_rxm, psm3, tcp;ofi_rxm) and publishes it; a rank that asked for another
 *      provider fails with DTR_INVALID_ARGUMENT naming both. Socket providers bind to the
 *      loopback interface when the job is on one host; $DTR_FABRIC_DOMAIN picks a domain
 *      (interface or NIC name) by hand.
 *   4. Each rank opens fabric, domain, completion queue, address vector and endpoint,
 *      publishes its endpoint name and inserts every peer's.
 *   5. First contact (dtr__fab_hello): every pair exchanges a hello, the lower rank first.
 *
 * Messages: fi_tsend / fi_trecv with FI_DIRECTED_RECV (match on source and the whole 64-bit
 * tag); messages up to the provider's inject size go through fi_tinject and complete at once.
 * Progress is manual: every test / wait_any / progress call reads the completion queue under
 * one lock. wait_any polls for $DTR_FABRIC_SPIN_US microseconds (default 20), then naps
 * (4 us doubling up to $DTR_FABRIC_NAP_US, default 64) so an idle rank costs almost no CPU.
 *
 * Failures: a completion error (a broken connection, a cancelled receive) fails its request
 * with DTR_PEER_FAILED naming the peer; a message longer than its receive buffer fails the
 * receive with DTR_INVALID_ARGUMENT. A watchdog thread (every 50 ms) notices a peer process
 * on this host that died (its pid is gone or a zombie) and a remote peer whose heartbeat
 * counter in the store stopped (no beat for max(2 s, min(timeout / 2, 30 s))), and reads
 * the world's abort key: abort() on any rank writes it, so every rank breaks within about
 * 250 ms with DTR_PEER_FAILED naming the same rank. A rank that closes cleanly first marks
 * itself as left, so its exit is not mistaken for a death.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"

#ifdef DTR_USE_LIBFABRIC
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/types.h>
#include <dirent.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#define DTR__FAB_VERSION FI_VERSION(1, 9)
#define DTR__FAB_PROV 64
#define DTR__FAB_ADDR 512          /* largest endpoint name */

dtr_result dtr_fabric_providers(char *buf, size_t len) {
    struct fi_info *hints, *info = NULL, *cur;
    size_t used = 0;
    int rc;
    if (!buf || !len) return DTR_NULL_HANDLE;
    buf[0] = 0;
    hints = fi_allocinfo();
    if (!hints) return DTR_OUT_OF_MEMORY;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_TAGGED | FI_DIRECTED_RECV;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    rc = fi_getinfo(DTR__FAB_VERSION, NULL, NULL, 0, hints, &info);
    fi_freeinfo(hints);
    if (rc == -FI_ENODATA) return DTR_NOT_FOUND;
    if (rc) return DTR_UNSUPPORTED;
    for (cur = info; cur; cur = cur->next) {
        const char *name = cur->fabric_attr->prov_name;
        const char *p = buf;
        size_t nl = strlen(name);
        int seen = 0;
        while ((p = strstr(p, name)) != NULL) {   /* whole lines only: "tcp" is not "tcp;ofi_rxm" */
            if ((p == buf || p[-1] == '\n') && (p[nl] == '\n' || p[nl] == 0)) { seen = 1; break; }
            p += nl;
        }
        if (seen) continue;
        used += (size_t)snprintf(buf + used, used < len ? len - used : 0, "%s%s", used ? "\n" : "", name);
        if (used >= len) { buf[len - 1] = 0; break; }
    }
    fi_freeinfo(info);
    return DTR_OK;
}

/* ---- state ---- */

/* Point-to-point messages of the application (tags with DTR__TAG_P2P) go as two: a header
   of 8 bytes (the length, injected, tag | DTR__FAB_HDR) and the payload. The receiver reads
   the header first and receives the payload into its buffer, or into a scratch buffer when
   it is too long, so a mismatched length is DTR_INVALID_ARGUMENT on the receiver whatever
   the provider does with truncated messages (some hang on them). Collectives never need it:
   their lengths agree by construction. */
#define DTR__FAB_HDR ((uint64_t)1 << 46)

enum { DTR__FQ_ONE = 0, DTR__FQ_HDR, DTR__FQ_BODY, DTR__FQ_TRASH };
/* where a request is (under mu): in the post list, taken by the provider thread, with the provider */
enum { DTR__FW_QUEUED = 0, DTR__FW_POSTING, DTR__FW_POSTED, DTR__FW_IDLE };
/* released: 0 no, 1 its releaser waits for its cancellation, 2 abandoned (recycled when it completes) */

typedef struct dtr__freq {
    struct fi_context2 ctx;      /* first: the provider's per-operation context */
    /* the provider thread's alone once queued */
    int stage;                   /* DTR__FQ_*: receives of application messages go HDR, then BODY or TRASH */
    int hdr_proto;               /* an application message: header, then payload */
    int sent_hdr;
    uint64_t hdr;                /* the header received: the payload's length */
    uint64_t tag;
    void *buf;
    void *trash;                 /* scratch for a payload longer than buf */
    int64_t give_up;             /* a post the provider refuses (queue full) fails after this */
    int peer, is_recv;
    size_t bytes;
    /* under mu */
    int where;                   /* DTR__FW_* */
    int cancel;                  /* the provider thread is to cancel it */
    int done;                    /* the completion arrived (or it never needed one) */
    int released;
    dtr_result result;
    int native;
    char msg[160];
    struct dtr__freq *next_free, *next_all, *next_post;
} dtr__freq;

typedef struct dtr__fab {
    dtr_allocation_callbacks alloc;
    int rank, size, local_rank, local_size;
    char prov[DTR__FAB_PROV];
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;           /* only the provider thread calls into libfabric once it runs */
    fi_addr_t *addrs;
    size_t inject;
    int64_t spin_ns;             /* the provider thread polls this long after an event, then naps */
    const char *want_domain;     /* cfg.fabric.domain or $DTR_FABRIC_DOMAIN; NULL: the provider's first */
    int64_t max_nap_ns;          /* the longest nap */
    int64_t timeout_ns;          /* the group's deadline setting: bounds retries of full queues */
    dtr__boot boot;              /* the store connection, namespace, hosts and pids (src/comm/bootstrap.c) */
    int *left;                   /* per peer: 1 closed cleanly (its requests fail, "rank N left"), 2 died
                                    (cfg.isolate_peer_failures: its requests fail, the world goes on) */
    int *leaving;                /* per peer: the watchdog read its "left" key (1) or saw it die (2); the
                                    thread applies it after a poll */
    int isolate;                 /* cfg.isolate_peer_failures */
    int64_t *pid_seen;           /* isolate: per peer of this host, when the thread last looked at its pid */
    int64_t round_ns;            /* when the provider thread's current round began (0: between rounds);
                                    atomic (relaxed): the watchdog reads it */
    /* requests, the provider thread's work and the world's failure, under mu */
    pthread_mutex_t mu;
    pthread_cond_t work_cv;      /* the provider thread waits for work */
    pthread_cond_t done_cv;      /* waiters wait for completions */
    dtr__freq *free_reqs, *all_reqs;
    dtr__freq *post_head, *post_tail;   /* requests to post, oldest first */
    dtr__freq *retry, *retry_tail;   /* the thread's own: posts the provider refused for now, in order */
    int ncancel, inflight, nleaving, want_close_ep, sleepers;
    int ep_closed;               /* the provider thread closed the endpoint (want_close_ep): it
                                    touches no buffer any more */
    unsigned events;             /* completions so far (waiters spin on it briefly, without the lock:
                                    written atomically under it) */
    pthread_t thread;
    int thread_on, closing, exited;
    /* world failure; `aborted` is also read without the lock (dtr__fab_aborted: atomic) */
    int aborted;
    int failed_rank;
    char why[200];
    int publish;                 /* the abort is ours: the watchdog writes it to the store */
    dtr__watchdog wd;            /* src/comm/watchdog.c */
} dtr__fab;

static void dtr__ferr(dtr_transport_error *err, int rank, int native, const char *fmt, ...) DTR__PRINTF(4, 5);
static void dtr__ferr(dtr_transport_error *err, int rank, int native, const char *fmt, ...) {
    va_list ap;
    if (!err) return;
    err->rank = rank;
    err->native_code = native;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
}

/* Marks the world failed and wakes every waiter (lock held). Returns 1 when this call did it. */
/* the world failed (a read without the lock sees it once the failing thread stored it) */
static int dtr__fab_aborted(const dtr__fab *f) { return DTR__ATOMIC_LOAD(&f->aborted); }

static int dtr__fab_fail_locked(dtr__fab *f, int rank, int publish, const char *fmt, ...) DTR__PRINTF(4, 5);
static int dtr__fab_fail_locked(dtr__fab *f, int rank, int publish, const char *fmt, ...) {
    va_list ap;
    if (f->aborted) return 0;   /* under the lock: the only writer */
    f->failed_rank = rank;
    va_start(ap, fmt);
    vsnprintf(f->why, sizeof f->why, fmt, ap);
    va_end(ap);
    f->publish = publish;
    DTR__ATOMIC_STORE(&f->aborted, 1);
    pthread_cond_broadcast(&f->done_cv);
    pthread_cond_signal(&f->work_cv);
    return 1;
}

static void dtr__fab_wake_watchdog(dtr__fab *f) { dtr__watchdog_wake(&f->wd); }
/* ---- requests (under mu) ---- */

static dtr__freq *dtr__freq_get(dtr__fab *f, int peer, int is_recv, void *buf, size_t bytes, uint64_t tag) {
    dtr__freq *q = f->free_reqs;
    if (q) f->free_reqs = q->next_free;
    else {
        q = (dtr__freq *)dtr__calloc(&f->alloc, sizeof *q);
        if (!q) return NULL;
        q->next_all = f->all_reqs;
        f->all_reqs = q;
    }
    memset(&q->ctx, 0, sizeof q->ctx);
    q->stage = DTR__FQ_ONE;
    q->hdr_proto = (tag & DTR__TAG_P2P) && f->inject >= sizeof q->hdr;
    q->sent_hdr = 0;
    q->hdr = 0;
    q->tag = tag;
    q->buf = buf;
    q->trash = NULL;
    q->give_up = 0;
    q->peer = peer;
    q->is_recv = is_recv;
    q->bytes = bytes;
    q->where = DTR__FW_QUEUED;
    q->cancel = q->done = q->released = 0;
    q->result = DTR_OK;
    q->native = 0;
    q->msg[0] = 0;
    q->next_free = q->next_post = NULL;
    return q;
}

static void dtr__freq_put(dtr__fab *f, dtr__freq *q) {
    q->next_free = f->free_reqs;
    f->free_reqs = q;
}

/* q is complete (lock held): waiters hear of it; an abandoned request is recycled. */
static void dtr__freq_complete(dtr__fab *f, dtr__freq *q) {
    if (q->trash) { dtr__free(&f->alloc, q->trash); q->trash = NULL; }
    if (q->where == DTR__FW_POSTED) f->inflight--;
    if (q->cancel) { q->cancel = 0; f->ncancel--; }
    q->where = DTR__FW_IDLE;
    q->done = 1;
    DTR__ATOMIC_STORE_RELAXED(&f->events, f->events + 1);   /* waiters spin on it without the lock */
    if (q->released == 2) dtr__freq_put(f, q);
    if (f->sleepers) pthread_cond_broadcast(&f->done_cv);
}

static void dtr__freq_fail(dtr__fab *f, dtr__freq *q, dtr_result r, int native, const char *fmt, ...) DTR__PRINTF(5, 6);
static void dtr__freq_fail(dtr__fab *f, dtr__freq *q, dtr_result r, int native, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(q->msg, sizeof q->msg, fmt, ap);
    va_end(ap);
    q->result = r;
    q->native = native;
    dtr__freq_complete(f, q);
}

/* 1 when the caller may stop waiting for q (lock held): it is complete, its peer left, or
   the world failed. */
static int dtr__freq_finished(const dtr__fab *f, const dtr__freq *q) {
    return q->done || f->left[q->peer] || dtr__fab_aborted(f);
}

/* How peer p is gone (left[p] or leaving[p] set). */
static const char *dtr__fab_gone(const dtr__fab *f, int p) {
    return f->left[p] == 2 || f->leaving[p] == 2 ? "died" : "left (closed its group)";
}

/* The result of a finished request (lock held). */
static dtr_result dtr__freq_result(dtr__fab *f, dtr__freq *q, dtr_transport_error *err) {
    if (q->done) {
        if (q->result != DTR_OK) dtr__ferr(err, q->peer, q->native, "%s", q->msg);
        return q->result;
    }
    if (f->left[q->peer] && !dtr__fab_aborted(f)) {
        dtr__ferr(err, q->peer, 0, "rank %d %s while this rank %s it", q->peer, dtr__fab_gone(f, q->peer),
                  q->is_recv ? "waited for a message from" : "sent to");
        return DTR_PEER_FAILED;
    }
    dtr__ferr(err, f->failed_rank, 0, "rank %d failed: %s", f->failed_rank, f->why);
    return DTR_PEER_FAILED;
}

/* ---- the provider thread ----
 * Only this thread calls into libfabric once the endpoint is open: posts, cancellations,
 * the completion queue, teardown. Callers queue requests and wait on a condition variable
 * with their deadline, and the watchdog breaks the world under `mu`, which is never held
 * across a libfabric call: a provider that spins forever (shm, on a queue lock a killed
 * peer held) stops this thread only, never a waiter. Such an endpoint is abandoned at close. */

/* One libfabric post of q (no lock). 0, -FI_EAGAIN, or another error. */
static ssize_t dtr__fab_post_one(dtr__fab *f, dtr__freq *q) {
    fi_addr_t a = f->addrs[q->peer];
    if (!f->ep) return -FI_ECANCELED;
    if (q->stage == DTR__FQ_BODY || q->stage == DTR__FQ_TRASH)
        return fi_trecv(f->ep, q->stage == DTR__FQ_TRASH ? q->trash : q->buf, (size_t)q->hdr, NULL, a, q->tag, 0, &q->ctx);
    if (q->is_recv && q->hdr_proto) {
        q->stage = DTR__FQ_HDR;
        return fi_trecv(f->ep, &q->hdr, sizeof q->hdr, NULL, a, q->tag | DTR__FAB_HDR, 0, &q->ctx);
    }
    if (q->is_recv) return fi_trecv(f->ep, q->buf, q->bytes, NULL, a, q->tag, 0, &q->ctx);
    if (q->hdr_proto && !q->sent_hdr) {
        uint64_t len = (uint64_t)q->bytes;
        ssize_t rc = fi_tinject(f->ep, &len, sizeof len, a, q->tag | DTR__FAB_HDR);
        if (rc) return rc;
        q->sent_hdr = 1;
    }
    if (q->bytes <= f->inject) return fi_tinject(f->ep, q->buf, q->bytes, a, q->tag);
    return fi_tsend(f->ep, q->buf, q->bytes, NULL, a, q->tag, &q->ctx);
}

static void dtr__fab_wd_died(void *t, int p, const char *how);

/* Isolated failures, a send to peer p of this host: 1 when p's process is gone, which the
 * watchdog (a tick of 50 ms) may not have seen yet. shm: a peer killed while it held its own
 * queue's lock makes a send to it spin inside the provider for ever, and this thread with it,
 * so the pid is looked at before the send (at most once a millisecond a peer). */
static int dtr__fab_died_now(dtr__fab *f, int p) {
    int64_t now;
    if (!f->isolate || !f->boot.on_host || !f->boot.on_host[p]) return 0;
    now = dtr_time_ns();
    if (now - f->pid_seen[p] < 1000000) return 0;
    f->pid_seen[p] = now;
    if (!dtr__pid_dead(f->boot.pids[p])) return 0;
    dtr__fab_wd_died(f, p, "");   /* as the watchdog would: its requests fail after a poll */
    return 1;
}

/* q was released or the world failed before q reached the provider (lock held): it fails
   without being posted, so its buffer, which the application may free now, is never read. */
static int dtr__fab_post_refused(dtr__fab *f, dtr__freq *q) {
    if (!q->released && !dtr__fab_aborted(f)) return 0;
    if (q->released) dtr__freq_fail(f, q, DTR_PEER_FAILED, 0, "released before it was posted");
    else dtr__freq_fail(f, q, DTR_PEER_FAILED, 0, "rank %d failed: %s", f->failed_rank, f->why);
    return 1;
}

/* Tries to post q (no lock held): 1 when the provider refused it for now (queues full). */
static int dtr__fab_try_post(dtr__fab *f, dtr__freq *q) {
    ssize_t rc;
    int refused;
    pthread_mutex_lock(&f->mu);
    refused = dtr__fab_post_refused(f, q);
    pthread_mutex_unlock(&f->mu);
    if (refused) return 0;
    if (f->left[q->peer] == 2 || (!q->is_recv && dtr__fab_died_now(f, q->peer))) {   /* died (isolated): nothing more goes to it */
        pthread_mutex_lock(&f->mu);
        dtr__freq_fail(f, q, DTR_PEER_FAILED, 0, "rank %d died", q->peer);
        pthread_mutex_unlock(&f->mu);
        return 0;
    }
    rc = dtr__fab_post_one(f, q);
    if (rc == -FI_ENOMEM) rc = -FI_EAGAIN;   /* shm: its receive entries ran out for now */
    int64_t now = rc == -FI_EAGAIN ? dtr_time_ns() : 0;
    /* retried until the world fails or well past any deadline of the waiter (whose timeout
       names the culprit the ranks agree on) */
    if (rc == -FI_EAGAIN && !q->give_up) q->give_up = now + f->timeout_ns + (int64_t)2000000000;
    if (rc == -FI_EAGAIN && now < q->give_up && !dtr__fab_aborted(f)) return 1;
    pthread_mutex_lock(&f->mu);
    if (rc == -FI_EAGAIN && dtr__fab_aborted(f))
        dtr__freq_fail(f, q, DTR_PEER_FAILED, (int)rc, "rank %d failed: %s", f->failed_rank, f->why);
    else if (rc == -FI_EAGAIN)
        dtr__freq_fail(f, q, DTR_PEER_FAILED, (int)rc, "the %s rank %d could not be posted within %lld ms: the provider's "
                       "queues stay full", q->is_recv ? "receive from" : "send to", q->peer,
                       (long long)(f->timeout_ns / 1000000 + 2000));
    else if (rc)
        dtr__freq_fail(f, q, DTR_PEER_FAILED, (int)rc, "posting a %s rank %d failed: %s", q->is_recv ? "receive from" : "send to",
                       q->peer, fi_strerror((int)-rc));
    else if (!q->is_recv && q->bytes <= f->inject) dtr__freq_complete(f, q);   /* injected: the buffer is free already */
    else {
        q->where = DTR__FW_POSTED;
        f->inflight++;
        if (q->released && f->sleepers) pthread_cond_broadcast(&f->done_cv);   /* its releaser's wait shortens */
    }
    pthread_mutex_unlock(&f->mu);
    return 0;
}

/* Posts q, or queues it behind the refused ones: posts keep their order (messages of one tag
   match in the order they were posted). */
static void dtr__fab_post_req(dtr__fab *f, dtr__freq *q) {
    q->next_post = NULL;
    if (!f->retry && !dtr__fab_try_post(f, q)) return;
    if (f->retry_tail) f->retry_tail->next_post = q;
    else f->retry = q;
    f->retry_tail = q;
}

/* Posts the refused requests, oldest first, until the provider refuses one again. The next
   one is read first: a request that fails there (released, the world failed) may be recycled
   and posted anew by another thread before try_post returns. */
static int dtr__fab_retry(dtr__fab *f) {
    int n = 0;
    while (f->retry) {
        dtr__freq *next = f->retry->next_post;
        if (dtr__fab_try_post(f, f->retry)) break;
        f->retry = next;
        if (!f->retry) f->retry_tail = NULL;
        n++;
    }
    return n;
}

/* A completion of q, good or failed (code: 0 or the positive libfabric error); lock held.
   Returns 1 when q's payload receive is to be posted next (its header arrived). */
static int dtr__fab_event(dtr__fab *f, dtr__freq *q, int code, const char *detail) {
    if (!code && q->stage == DTR__FQ_HDR && (q->released || dtr__fab_aborted(f))) {
        dtr__freq_fail(f, q, DTR_PEER_FAILED, 0, "the group failed before the message from rank %d arrived", q->peer);
        return 0;
    }
    if (!code && q->stage == DTR__FQ_HDR) {
        if (q->hdr > (uint64_t)q->bytes && !(q->trash = dtr__malloc(&f->alloc, q->hdr ? (size_t)q->hdr : 1))) {
            dtr__freq_fail(f, q, DTR_OUT_OF_MEMORY, 0, "out of memory for the %llu bytes of a too long message from rank %d",
                           (unsigned long long)q->hdr, q->peer);
            return 0;
        }
        q->stage = q->trash ? DTR__FQ_TRASH : DTR__FQ_BODY;
        q->give_up = 0;
        return 1;
    }
    if (!code && q->stage == DTR__FQ_TRASH)
        dtr__freq_fail(f, q, DTR_INVALID_ARGUMENT, 0, "a message of %llu bytes from rank %d is longer than the receive "
                       "buffer of %zu bytes", (unsigned long long)q->hdr, q->peer, q->bytes);
    else if (!code) dtr__freq_complete(f, q);
    else if (code == FI_ETRUNC)
        dtr__freq_fail(f, q, DTR_INVALID_ARGUMENT, -code, "a message from rank %d is longer than the receive buffer of %zu "
                       "bytes", q->peer, q->bytes);
    else if (code == FI_ECANCELED && f->left[q->peer])
        dtr__freq_fail(f, q, DTR_PEER_FAILED, -code, "rank %d %s while this rank %s it", q->peer, dtr__fab_gone(f, q->peer),
                       q->is_recv ? "waited for a message from" : "sent to");
    else if (code == FI_ECANCELED)
        dtr__freq_fail(f, q, DTR_PEER_FAILED, -code, "the %s rank %d was cancelled", q->is_recv ? "receive from" : "send to",
                       q->peer);
    else
        dtr__freq_fail(f, q, DTR_PEER_FAILED, -code, "%s rank %d failed: %s (libfabric %s, error %d)",
                       q->is_recv ? "receiving from" : "sending to", q->peer, detail, f->prov, code);
    return 0;
}

/* Reads the completion queue (no lock held): the number of completions, or -1 when the
   queue itself failed. */
static int dtr__fab_read_cq(dtr__fab *f) {
    struct fi_cq_entry ev[16];
    dtr__freq *body[16];
    int total = 0, nb = 0, i, code;
    for (;;) {
        ssize_t n = fi_cq_read(f->cq, ev, 16);
        if (n > 0) {
            pthread_mutex_lock(&f->mu);
            for (i = 0; i < (int)n; i++)
                if (dtr__fab_event(f, (dtr__freq *)ev[i].op_context, 0, "")) body[nb++] = (dtr__freq *)ev[i].op_context;
            pthread_mutex_unlock(&f->mu);
            for (i = 0; i < nb; i++) dtr__fab_post_req(f, body[i]);
            total += (int)n;
            nb = 0;
            if (n < 16) return total;
        } else if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry e;
            char detail[128];
            memset(&e, 0, sizeof e);
            if (fi_cq_readerr(f->cq, &e, 0) <= 0) return total;
            code = e.err < 0 ? -e.err : (e.err ? e.err : FI_EOTHER);   /* shm reports it negative */
            detail[0] = 0;
            if (code != FI_ECANCELED && code != FI_ETRUNC)
                snprintf(detail, sizeof detail, "%s", fi_cq_strerror(f->cq, e.prov_errno, e.err_data, NULL, 0));
            if (!e.op_context) continue;
            pthread_mutex_lock(&f->mu);
            dtr__fab_event(f, (dtr__freq *)e.op_context, code, detail);
            pthread_mutex_unlock(&f->mu);
            total++;
        } else if (n == -FI_EAGAIN) {
            return total;
        } else {
            pthread_mutex_lock(&f->mu);
            dtr__fab_fail_locked(f, f->rank, 1, "rank %d: reading the completion queue failed: %s", f->rank, fi_strerror((int)-n));
            pthread_mutex_unlock(&f->mu);
            dtr__fab_wake_watchdog(f);
            return -1;
        }
    }
}

/* The requests to cancel and the peers that left (lock held): fills list, returns its length. */
static int dtr__fab_take_cancels(dtr__fab *f, dtr__freq **list, int cap) {
    dtr__freq *q;
    int n = 0, p;
    for (p = 0; f->nleaving && p < f->size; p++)
        if (f->leaving[p]) {
            f->left[p] = f->leaving[p];
            f->leaving[p] = 0;
            f->nleaving--;
            pthread_cond_broadcast(&f->done_cv);
            for (q = f->all_reqs; q; q = q->next_all)
                if (q->peer == p && q->is_recv && q->where == DTR__FW_POSTED && !q->cancel) { q->cancel = 1; f->ncancel++; }
        }
    for (q = f->all_reqs; f->ncancel && q && n < cap; q = q->next_all)
        if (q->cancel && q->where == DTR__FW_POSTED && q->cancel == 1) { q->cancel = 2; list[n++] = q; }
    return n;
}

/* One round of the provider thread (no lock held): posts, retries, cancellations, the
   completion queue. Returns the number of things that happened. */
static int dtr__fab_round(dtr__fab *f, dtr__freq *batch) {
    dtr__freq *q, *next, *cancels[32];
    int n = 0, nc, i, close_ep;
    n += dtr__fab_retry(f);
    for (q = batch; q; q = next) { next = q->next_post; dtr__fab_post_req(f, q); n++; }
    pthread_mutex_lock(&f->mu);
    nc = dtr__fab_take_cancels(f, cancels, 32);
    close_ep = f->want_close_ep && f->ep;
    pthread_mutex_unlock(&f->mu);
    for (i = 0; i < nc && f->ep; i++) fi_cancel(&f->ep->fid, &cancels[i]->ctx);
    if (close_ep) {   /* the world failed: the provider lets go of every buffer; later posts fail */
        fi_close(&f->ep->fid);
        f->ep = NULL;
        pthread_mutex_lock(&f->mu);
        f->ep_closed = 1;
        pthread_cond_broadcast(&f->done_cv);   /* releases that gave up wait for this */
        pthread_mutex_unlock(&f->mu);
    }
    i = dtr__fab_read_cq(f);
    return n + nc + (i > 0 ? i : 0);
}

static int dtr__fab_has_work(const dtr__fab *f) {
    return f->post_head || f->retry || f->inflight || f->nleaving || (f->want_close_ep && f->ep) || f->ncancel;
}

/* closing: cancels every pending receive and drains the queue briefly; the closing thread
   then closes every object (dtr__fab_free) once this one has exited */
static void dtr__fab_thread_teardown(dtr__fab *f) {
    int64_t until = dtr_time_ns() + 100000000;
    dtr__freq *q;
    pthread_mutex_lock(&f->mu);
    for (q = f->all_reqs; q; q = q->next_all)
        if (q->where == DTR__FW_POSTED && q->is_recv && !q->cancel) { q->cancel = 1; f->ncancel++; }
    if (dtr__fab_aborted(f)) f->want_close_ep = 1;   /* sends to dead peers: let go of their buffers now */
    pthread_mutex_unlock(&f->mu);
    do dtr__fab_round(f, NULL); while (f->inflight && dtr_time_ns() < until);
}

static void *dtr__fab_thread(void *arg) {
    dtr__fab *f = (dtr__fab *)arg;
    int64_t nap = 4000, spin_until = 0;
#ifdef __linux__
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);   /* naps of a few microseconds */
#endif
    pthread_mutex_lock(&f->mu);
    for (;;) {
        dtr__freq *batch, *q;
        int got;
        while (!f->closing && !dtr__fab_has_work(f)) dtr__cond_wait_until(&f->work_cv, &f->mu, -1);
        if (f->closing) break;
        batch = f->post_head;
        f->post_head = f->post_tail = NULL;
        for (q = batch; q; q = q->next_post) q->where = DTR__FW_POSTING;
        pthread_mutex_unlock(&f->mu);
        DTR__ATOMIC_STORE_RELAXED(&f->round_ns, dtr_time_ns());
        got = dtr__fab_round(f, batch);
        DTR__ATOMIC_STORE_RELAXED(&f->round_ns, 0);
        pthread_mutex_lock(&f->mu);
        if (got) { nap = 4000; spin_until = dtr_time_ns() + f->spin_ns; continue; }
        if (dtr_time_ns() < spin_until || f->post_head) continue;
        dtr__cond_wait_until(&f->work_cv, &f->mu, dtr_time_ns() + nap);   /* a new post wakes it */
        if (nap < f->max_nap_ns) nap *= 2;
    }
    pthread_mutex_unlock(&f->mu);
    dtr__fab_thread_teardown(f);
    pthread_mutex_lock(&f->mu);
    f->exited = 1;
    pthread_cond_broadcast(&f->done_cv);
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

/* ---- the transport's calls ---- */

static dtr_result dtr__fab_post(dtr__fab *f, int is_recv, void *buf, size_t bytes, int peer, uint64_t tag, void **req,
                                dtr_transport_error *err) {
    dtr__freq *q;
    *req = NULL;
    if (peer < 0 || peer >= f->size) {
        dtr__ferr(err, -1, 0, "rank %d outside the world of %d", peer, f->size);
        return DTR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&f->mu);
    if (dtr__fab_aborted(f) || f->left[peer]) {
        dtr__freq tmp;
        dtr_result r;
        memset(&tmp, 0, sizeof tmp);
        tmp.peer = peer;
        tmp.is_recv = is_recv;
        r = dtr__freq_result(f, &tmp, err);   /* the world's or the peer's error */
        pthread_mutex_unlock(&f->mu);
        return r;
    }
    q = dtr__freq_get(f, peer, is_recv, buf, bytes, tag);
    if (!q) {
        pthread_mutex_unlock(&f->mu);
        dtr__ferr(err, -1, 0, "out of memory");
        return DTR_OUT_OF_MEMORY;
    }
    if (f->post_tail) f->post_tail->next_post = q;
    else f->post_head = q;
    f->post_tail = q;
    pthread_cond_signal(&f->work_cv);
    pthread_mutex_unlock(&f->mu);
    *req = q;
    return DTR_OK;
}

static dtr_result dtr__fab_isend(void *state, const void *buf, size_t bytes, int dst, uint64_t tag, void **req,
                                 dtr_transport_error *err) {
    return dtr__fab_post((dtr__fab *)state, 0, (void *)(uintptr_t)buf, bytes, dst, tag, req, err);
}

static dtr_result dtr__fab_irecv(void *state, void *buf, size_t bytes, int src, uint64_t tag, void **req,
                                 dtr_transport_error *err) {
    return dtr__fab_post((dtr__fab *)state, 1, buf, bytes, src, tag, req, err);
}

static dtr_result dtr__fab_test(void *state, void *req, int *done, dtr_transport_error *err) {
    dtr__fab *f = (dtr__fab *)state;
    dtr__freq *q = (dtr__freq *)req;
    dtr_result r = DTR_OK;
    pthread_mutex_lock(&f->mu);
    *done = dtr__freq_finished(f, q);
    if (*done) r = dtr__freq_result(f, q, err);
    pthread_mutex_unlock(&f->mu);
    return r;
}

/* The first finished request of reqs (lock held): 1 (result in *r) or 0 while all pend;
   *pending: the first pending one. */
static int dtr__fab_any_finished(dtr__fab *f, void *const *reqs, int n, int *pending, dtr_result *r,
                                 dtr_transport_error *err) {
    int i;
    *pending = -1;
    for (i = 0; i < n; i++) {
        dtr__freq *q = (dtr__freq *)reqs[i];
        if (!q) continue;
        if (dtr__freq_finished(f, q)) { *r = DTR_OK; return 1; }
        if (*pending < 0) *pending = i;
    }
    if (*pending < 0) { *r = DTR_OK; return 1; }
    if (dtr__fab_aborted(f)) {
        dtr__ferr(err, f->failed_rank, 0, "rank %d failed: %s", f->failed_rank, f->why);
        *r = DTR_PEER_FAILED;
        return 1;
    }
    return 0;
}

/* The deadline passed while q pends: the rank every rank blames (src/comm/watchdog.c). */
static dtr_result dtr__fab_timed_out(dtr__fab *f, const dtr__freq *q, dtr_transport_error *err) {
    char why[300];
    int64_t round = DTR__ATOMIC_LOAD_RELAXED(&f->round_ns), in = round ? (dtr_time_ns() - round) / 1000000 : 0;
    int who = dtr__watchdog_culprit(&f->wd, q->peer, why, 200);
    if (in > 1000)   /* the provider never came back (shm: a peer killed while it held a queue's lock) */
        snprintf(why + strlen(why), sizeof why - strlen(why), " (this rank's provider thread has been inside libfabric "
                 "for %lld ms%s)", (long long)in, f->leaving[q->peer] == 2 ? ", after its death was seen" : "");
    if (who == q->peer)
        dtr__ferr(err, who, 0, "rank %d did not %s (%zu bytes) in time%s%s", q->peer,
                  q->is_recv ? "send the message this rank waits for" : "take the message this rank sends", q->bytes,
                  why[0] ? ": " : "", why);
    else
        dtr__ferr(err, who, 0, "rank %d (this rank waited for rank %d, which waits for it): %s", who, q->peer, why);
    return DTR_TIMEOUT;
}

/* wait_any (soft = 0) and wait_some (soft = 1: the deadline is no failure) */
static dtr_result dtr__fab_wait(dtr__fab *f, void *const *reqs, int n, int64_t deadline_ns, int soft,
                                dtr_transport_error *err) {
    int64_t spin_until = dtr_time_ns() + f->spin_ns;
    dtr_result r = DTR_OK;
    int pending;
    pthread_mutex_lock(&f->mu);
    for (;;) {
        unsigned seen;
        int64_t now;
        if (dtr__fab_any_finished(f, reqs, n, &pending, &r, err)) break;
        now = dtr_time_ns();
        if (now >= deadline_ns && soft) break;
        if (now >= deadline_ns) {
            dtr__freq *q = (dtr__freq *)reqs[pending];
            pthread_mutex_unlock(&f->mu);
            return dtr__fab_timed_out(f, q, err);
        }
        seen = f->events;
        if (now < spin_until) {   /* a completion is often a few microseconds away */
            pthread_mutex_unlock(&f->mu);
            while (DTR__ATOMIC_LOAD_RELAXED(&f->events) == seen && !dtr__fab_aborted(f) && dtr_time_ns() < spin_until) {}
            pthread_mutex_lock(&f->mu);
            continue;
        }
        f->sleepers++;
        dtr__cond_wait_until(&f->done_cv, &f->mu, deadline_ns);
        f->sleepers--;
    }
    pthread_mutex_unlock(&f->mu);
    return r;
}

static dtr_result dtr__fab_wait_any(void *state, void *const *reqs, int n, int64_t deadline_ns,
                                    dtr_transport_error *err) {
    return dtr__fab_wait((dtr__fab *)state, reqs, n, deadline_ns, 0, err);
}

static dtr_result dtr__fab_wait_some(void *state, void *const *reqs, int n, int64_t until_ns) {
    dtr_transport_error e;
    return dtr__fab_wait((dtr__fab *)state, reqs, n, until_ns, 1, &e);
}

/* Waits (lock held) for released q to complete until `until`; while the provider thread holds
   it for posting (it posts it, then cancels it, or fails it unposted: dtr__fab_post_refused)
   up to the group's deadline past that: its buffer is never let go of in the middle of a post. */
static void dtr__fab_release_wait(dtr__fab *f, dtr__freq *q, int64_t until) {
    int64_t hard = until + f->timeout_ns;
    while (!q->done) {
        int64_t lim = q->where == DTR__FW_POSTING ? hard : until;
        if (dtr_time_ns() >= lim) break;
        dtr__cond_wait_until(&f->done_cv, &f->mu, lim);
    }
}

/* Waits (lock held) until the provider thread closed the endpoint, at most until `until`. */
static void dtr__fab_wait_ep_closed(dtr__fab *f, int64_t until) {
    f->sleepers++;
    while (!f->ep_closed && dtr_time_ns() < until) dtr__cond_wait_until(&f->done_cv, &f->mu, until);
    f->sleepers--;
}

static void dtr__fab_release(void *state, void *req) {
    dtr__fab *f = (dtr__fab *)state;
    dtr__freq *q = (dtr__freq *)req, **pp;
    int64_t until = dtr_time_ns() + 100000000;
    if (!q) return;
    pthread_mutex_lock(&f->mu);
    if (q->where == DTR__FW_QUEUED) {   /* never reached the provider */
        dtr__freq *prev = NULL;
        for (pp = &f->post_head; *pp && *pp != q; pp = &(*pp)->next_post) prev = *pp;
        if (*pp) { *pp = q->next_post; if (f->post_tail == q) f->post_tail = prev; }
        q->done = 1;
    }
    if (!q->done && !q->is_recv && f->left[q->peer] == 2) {
        /* a send to a dead peer (isolated): abandoned, recycled if it ever completes */
        q->released = 2;
        pthread_mutex_unlock(&f->mu);
        return;
    }
    if (!q->done) {
        /* pending: the provider thread cancels it; wait a moment for the cancellation so the
           buffer is not touched after release returns */
        q->released = 1;
        if (!q->cancel) { q->cancel = 1; f->ncancel++; }
        pthread_cond_signal(&f->work_cv);
        f->sleepers++;
        dtr__fab_release_wait(f, q, until);
        f->sleepers--;
    }
    if (q->done) dtr__freq_put(f, q);
    else if (f->left[q->peer] == 2) q->released = 2;   /* its peer died (isolated): abandoned */
    else {
        /* the provider would not give it back (or is stuck): break the world and close the
           endpoint, after which the provider touches no buffer (waited for: the caller frees
           the buffer next); recycled if it ever completes */
        int mine;
        q->released = 2;
        f->want_close_ep = 1;
        pthread_cond_signal(&f->work_cv);
        mine = dtr__fab_fail_locked(f, f->rank, 1, "rank %d could not cancel a pending %s rank %d (%zu bytes)", f->rank,
                                    q->is_recv ? "receive from" : "send to", q->peer, q->bytes);
        dtr__fab_wait_ep_closed(f, until + f->timeout_ns);
        pthread_mutex_unlock(&f->mu);
        if (mine) dtr__fab_wake_watchdog(f);
        return;
    }
    pthread_mutex_unlock(&f->mu);
}

static void dtr__fab_abort(void *state, int failed_rank, const char *why) {
    dtr__fab *f = (dtr__fab *)state;
    int mine;
    pthread_mutex_lock(&f->mu);
    mine = dtr__fab_fail_locked(f, failed_rank, 1, "%s", why ? why : "aborted");
    pthread_mutex_unlock(&f->mu);
    if (mine) dtr__fab_wake_watchdog(f);
}

/* ---- the watchdog's callbacks (the watchdog itself: src/comm/watchdog.c) ---- */

static int dtr__fab_wd_failed(void *t) { return dtr__fab_aborted((dtr__fab *)t); }

static int dtr__fab_wd_to_publish(void *t, int *who, char *why, size_t cap) {
    dtr__fab *f = (dtr__fab *)t;
    int mine;
    pthread_mutex_lock(&f->mu);
    mine = dtr__fab_aborted(f) && f->publish;
    *who = f->failed_rank;
    snprintf(why, cap, "%s", f->why);
    pthread_mutex_unlock(&f->mu);
    return mine;
}

static void dtr__fab_wd_fail(void *t, int rank, const char *why, int publish) {
    dtr__fab *f = (dtr__fab *)t;
    pthread_mutex_lock(&f->mu);
    dtr__fab_fail_locked(f, rank, publish, "%s", why);
    pthread_mutex_unlock(&f->mu);
}

/* A peer closed cleanly: the provider thread reads what it sent before (one more poll),
   then requests still waiting for it fail, their receives cancelled. */
static void dtr__fab_wd_left(void *t, int p) {
    dtr__fab *f = (dtr__fab *)t;
    pthread_mutex_lock(&f->mu);
    if (!f->leaving[p] && !f->left[p]) { f->leaving[p] = 1; f->nleaving++; }
    pthread_cond_signal(&f->work_cv);
    pthread_mutex_unlock(&f->mu);
}
/* Isolated peer failures: peer p died; the provider thread reads what it sent before (one
   more poll), then the requests with it fail, its receives cancelled. */
static void dtr__fab_wd_died(void *t, int p, const char *how) {
    dtr__fab *f = (dtr__fab *)t;
    (void)how;
    pthread_mutex_lock(&f->mu);
    if (!f->leaving[p] && !f->left[p]) { f->leaving[p] = 2; f->nleaving++; }
    pthread_cond_signal(&f->work_cv);
    pthread_mutex_unlock(&f->mu);
}

/* The watchdog's tick: a provider thread that has not come back from libfabric for stale_ns
   is stuck for good (shm: a peer killed while it held its queue's lock makes every send to it
   spin): this rank cannot communicate any more, and the world hears of it. */
static void dtr__fab_wd_check(void *t, int64_t stale_ns) {
    dtr__fab *f = (dtr__fab *)t;
    int64_t since = DTR__ATOMIC_LOAD_RELAXED(&f->round_ns), ms;
    char dead[160] = "";
    int p;
    if (!since || dtr_time_ns() - since < stale_ns) return;
    ms = (dtr_time_ns() - since) / 1000000;
    pthread_mutex_lock(&f->mu);
    for (p = 0; p < f->size && !dead[0]; p++)
        if (f->left[p] == 2 || f->leaving[p] == 2)
            snprintf(dead, sizeof dead, " (wedged: rank %d died, and %s spins for ever on a queue lock a killed process "
                     "held)", p, f->prov);
    dtr__fab_fail_locked(f, f->rank, 1, "rank %d's libfabric provider thread has not come back from the provider for "
                         "%lld ms%s: this rank cannot communicate any more", f->rank, (long long)ms, dead);
    pthread_mutex_unlock(&f->mu);
}

static int dtr__fab_peer_alive(void *state, int p) {
    dtr__fab *f = (dtr__fab *)state;
    int alive;
    if (p < 0 || p >= f->size) return 0;
    pthread_mutex_lock(&f->mu);
    alive = (!f->left[p] && !f->leaving[p]) || dtr__fab_aborted(f);   /* a world failure is no peer's alone */
    pthread_mutex_unlock(&f->mu);
    return alive;
}
/* ---- open and close ---- */

/* shm names its region in /dev/shm after the pid unless told otherwise, and a process that
   was killed never removes it: a later process that gets the same pid cannot create its
   region (EBUSY). dtrain names the region "dtr-<pid>-<random>" and, before creating one,
   removes those whose process is gone. */
#define DTR__FAB_SHM_PREFIX "dtr-"

static void dtr__fab_shm_name(char *out, size_t cap) {
    uint64_t r = (uint64_t)dtr_time_ns() ^ ((uint64_t)getpid() << 32);
    FILE *fp = fopen("/dev/urandom", "rb");
    if (fp) {
        uint64_t u;
        if (fread(&u, sizeof u, 1, fp) == 1) r ^= u;
        fclose(fp);
    }
    snprintf(out, cap, DTR__FAB_SHM_PREFIX "%d-%016llx", (int)getpid(), (unsigned long long)r);
}

static void dtr__fab_shm_sweep(void) {
#ifdef __linux__
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    if (!d) return;
    while ((e = readdir(d)) != NULL) {
        char path[300];
        int pid = 0;
        if (strncmp(e->d_name, DTR__FAB_SHM_PREFIX, sizeof DTR__FAB_SHM_PREFIX - 1) != 0) continue;
        pid = atoi(e->d_name + sizeof DTR__FAB_SHM_PREFIX - 1);
        if (pid <= 0 || !(kill((pid_t)pid, 0) != 0 && errno == ESRCH)) continue;
        snprintf(path, sizeof path, "/dev/shm/%.250s", e->d_name);
        (void)unlink(path);   /* best effort: another rank may remove it first */
    }
    closedir(d);
#endif
}

/* A numeric setting: the config's value when set (> 0; -1 means 0), else the environment
 * variable's, else the default. */
static int64_t dtr__fab_setting(int value, const char *env_name, int64_t def) {
    const char *env = getenv(env_name);
    if (value > 0) return value;
    if (value < 0) return 0;
    return env && *env ? strtoll(env, NULL, 10) : def;
}

/* First contact, one way per pair: the lower rank sends a hello, the higher answers once it
 * has it; receives are posted first and posting one contacts nobody. Two ranks whose first
 * messages to each other crossed (the barrier's round of distance N/2 sends both ways at once)
 * lost one of them now and then, on shm and on tcp;ofi_rxm alike (libfabric 1.17; 1 start of
 * world 4 in 16 under a load of 6 on 2 cores: rank 2 waited in vain for rank 0's message while
 * rank 0 had moved on). After this exchange every pair has spoken. O(N) messages per rank.
 * The hellos carry a collective's tag (no length header): with an application tag (and its
 * header protocol), a rank SIGSTOPped and continued after its peers had failed crashed inside
 * tcp;ofi_rxm's fi_trecv (test_fabric's tcp matrix, 3 of 3). */
static void dtr__fab_close(void *state);
/* context 0, a collective's tag (no length header) whose step no collective reaches */
#define DTR__FAB_HELLO (((uint64_t)0x7fffff << 24) | (uint64_t)0xffffff)
static dtr_result dtr__fab_hello(dtr__fab *f, char *err, size_t errlen) {
    int n = f->size, me = f->rank, j, done;
    void **rq = (void **)calloc((size_t)(2 * n), sizeof(void *));
    unsigned char *in = (unsigned char *)calloc((size_t)n, 1), one = 1;
    int64_t deadline = dtr_time_ns() + f->timeout_ns;
    dtr_transport_error te;
    dtr_result r = rq && in ? DTR_OK : DTR_OUT_OF_MEMORY;
    memset(&te, 0, sizeof te);
    for (j = 0; j < n && r == DTR_OK; j++)   /* hellos from lower ranks, answers from higher ones */
        if (j != me) r = dtr__fab_post(f, 1, &in[j], 1, j, DTR__FAB_HELLO, &rq[j], &te);
    for (j = me + 1; j < n && r == DTR_OK; j++) r = dtr__fab_post(f, 0, &one, 1, j, DTR__FAB_HELLO, &rq[n + j], &te);
    while (r == DTR_OK && (r = dtr__fab_wait_any(f, rq, 2 * n, deadline, &te)) == DTR_OK) {
        int any = 0;
        for (j = 0; j < 2 * n && r == DTR_OK; j++) {
            if (!rq[j] || (r = dtr__fab_test(f, rq[j], &done, &te)) != DTR_OK || !done) continue;
            dtr__fab_release(f, rq[j]);
            rq[j] = NULL;
            if (j < me) r = dtr__fab_post(f, 0, &one, 1, j, DTR__FAB_HELLO, &rq[n + j], &te);   /* answer it */
            any = 1;
        }
        for (j = 0; j < 2 * n && !rq[j]; j++) {}
        if (j == 2 * n || !any) break;
    }
    for (j = 0; j < 2 * n; j++) dtr__fab_release(f, rq[j]);
    if (r != DTR_OK)
        dtr__errf(err, errlen, r, "libfabric rank %d: first contact with the other ranks failed: %s", me,
                  r == DTR_OUT_OF_MEMORY ? "out of memory" : te.msg);
    free(rq);
    free(in);
    return r;
}

static int dtr__fab_is_socket_prov(const char *prov) {
    return strstr(prov, "tcp") || strstr(prov, "sockets") || strstr(prov, "udp");
}

/* fi_getinfo for one provider name. loopback: prefer the 127.0.0.1 domain of socket providers. */
static int dtr__fab_getinfo(const char *prov, const char *want_domain, int loopback, struct fi_info **out) {
    struct fi_info *hints = fi_allocinfo(), *info = NULL, *cur, *pick = NULL;
    int rc;
    *out = NULL;
    if (!hints) return -FI_ENOMEM;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_TAGGED | FI_DIRECTED_RECV | FI_SEND | FI_RECV;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->addr_format = FI_FORMAT_UNSPEC;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->mr_mode = 0;   /* no registration: we only send and receive */
    hints->domain_attr->av_type = FI_AV_TABLE;
    hints->fabric_attr->prov_name = strdup(prov);
    if (!hints->fabric_attr->prov_name) { fi_freeinfo(hints); return -FI_ENOMEM; }
    rc = fi_getinfo(DTR__FAB_VERSION, NULL, NULL, 0, hints, &info);
    fi_freeinfo(hints);
    if (rc) return rc;
    for (cur = info; cur; cur = cur->next) {
        const char *dom = cur->domain_attr && cur->domain_attr->name ? cur->domain_attr->name : "";
        const char *fab = cur->fabric_attr && cur->fabric_attr->name ? cur->fabric_attr->name : "";
        if (strcmp(cur->fabric_attr->prov_name, prov) != 0) continue;
        if (want_domain && *want_domain) {
            if (!strcmp(dom, want_domain)) { pick = cur; break; }
            continue;
        }
        if (!pick) pick = cur;
        if (dtr__fab_is_socket_prov(prov)) {
            int lo = !strncmp(fab, "127.", 4);
            int v4 = cur->addr_format == FI_SOCKADDR_IN;
            if (loopback && lo) { pick = cur; break; }
            if (!loopback && v4 && !lo) { pick = cur; break; }
        } else break;
    }
    if (!pick) { fi_freeinfo(info); return -FI_ENODATA; }
    *out = fi_dupinfo(pick);
    fi_freeinfo(info);
    return *out ? 0 : -FI_ENOMEM;
}

static void dtr__fab_free(dtr__fab *f) {
    dtr__freq *q, *n;
    if (f->ep) fi_close(&f->ep->fid);
    if (f->av) fi_close(&f->av->fid);
    if (f->cq) fi_close(&f->cq->fid);
    if (f->domain) fi_close(&f->domain->fid);
    if (f->fabric) fi_close(&f->fabric->fid);
    if (f->info) fi_freeinfo(f->info);
    for (q = f->all_reqs; q; q = n) { n = q->next_all; dtr__free(&f->alloc, q); }
    f->boot.failed = dtr__fab_aborted(f);   /* bounded teardown after a failure (grace_ms) */
    dtr__boot_close(&f->boot);
    dtr__free(&f->alloc, f->addrs);
    dtr__free(&f->alloc, f->left);
    dtr__free(&f->alloc, f->leaving);
    dtr__free(&f->alloc, f->pid_seen);
    dtr__watchdog_free(&f->wd);
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->work_cv);
    pthread_cond_destroy(&f->done_cv);
    {
        dtr_allocation_callbacks a = f->alloc;
        dtr__free(&a, f);
    }
}

static dtr_result dtr__fab_open_ep(const dtr_comm_config *cfg, void **state, dtr_transport_info *info, char *err,
                                   size_t errlen) {
    dtr__fab *f;
    dtr_result r;
    char key[96], prov[DTR__FAB_PROV];
    const char *env;
    int i, rc, timeout = cfg->timeout_ms > 0 ? cfg->timeout_ms : dtr__default_timeout_ms();
    *state = NULL;
    f = (dtr__fab *)dtr__calloc(&cfg->alloc, sizeof *f);
    if (!f) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "libfabric: out of memory");
    f->alloc = cfg->alloc;
    f->failed_rank = -1;
    pthread_mutex_init(&f->mu, NULL);
    dtr__cond_init(&f->work_cv);
    dtr__cond_init(&f->done_cv);
    f->spin_ns = dtr__fab_setting(cfg->fabric.spin_us, "DTR_FABRIC_SPIN_US", 20) * 1000;
    f->max_nap_ns = dtr__fab_setting(cfg->fabric.nap_us, "DTR_FABRIC_NAP_US", 64) * 1000;
    f->want_domain = cfg->fabric.domain && *cfg->fabric.domain ? cfg->fabric.domain : getenv("DTR_FABRIC_DOMAIN");
    if (f->max_nap_ns < 1000) f->max_nap_ns = 1000;
    f->timeout_ns = (int64_t)timeout * 1000000;
    f->isolate = cfg->isolate_peer_failures != 0;
    if (f->spin_ns < 0) f->spin_ns = 0;

    /* 1-2. the store, this open's namespace, hosts and pids */
    if ((r = dtr__boot_open(&f->boot, cfg, "libfabric", "dtrfab", err, errlen)) != DTR_OK) {
        dtr__fab_free(f);
        return r;
    }
    f->rank = f->boot.rank;
    f->size = f->boot.size;
    f->local_rank = f->boot.local_rank;
    f->local_size = f->boot.local_size;
    f->addrs = (fi_addr_t *)dtr__calloc(&f->alloc, sizeof(fi_addr_t) * (size_t)f->size);
    f->left = (int *)dtr__calloc(&f->alloc, sizeof(int) * (size_t)f->size);
    f->leaving = (int *)dtr__calloc(&f->alloc, sizeof(int) * (size_t)f->size);
    f->pid_seen = (int64_t *)dtr__calloc(&f->alloc, sizeof(int64_t) * (size_t)f->size);
    if (!f->addrs || !f->left || !f->leaving || !f->pid_seen) {
        dtr__fab_free(f);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "libfabric: out of memory");
    }

    /* 3. the provider: rank 0 decides */
    prov[0] = 0;
    if (cfg->fabric.provider && *cfg->fabric.provider) snprintf(prov, sizeof prov, "%s", cfg->fabric.provider);
    else if ((env = getenv("DTR_FABRIC_PROVIDER")) != NULL && *env) snprintf(prov, sizeof prov, "%s", env);
    dtr__boot_key(&f->boot, key, sizeof key, "provider", -1);
    if (f->rank == 0) {
        if (!prov[0]) {
            static const char *const remote[] = {"cxi", "efa", "verbs;ofi_rxm", "psm3", "tcp;ofi_rxm"};
            const char *const *list = remote;
            static const char *const local[] = {"shm", "tcp;ofi_rxm"};
            int nlist = 5, k;
            if (f->local_size == f->size) { list = local; nlist = 2; }
            for (k = 0; k < nlist && !prov[0]; k++) {
                struct fi_info *probe = NULL;
                if (dtr__fab_getinfo(list[k], f->want_domain, f->local_size == f->size, &probe) == 0) {
                    snprintf(prov, sizeof prov, "%s", list[k]);
                    fi_freeinfo(probe);
                }
            }
            if (!prov[0]) {
                r = dtr__errf(err, errlen, DTR_UNSUPPORTED, "libfabric rank 0: no usable provider (tried %s)",
                              f->local_size == f->size ? "shm, tcp;ofi_rxm" : "cxi, efa, verbs;ofi_rxm, psm3, tcp;ofi_rxm");
                dtr_store_set(f->boot.st, key, "!", 1);
                dtr__fab_free(f);
                return r;
            }
        }
        if ((r = dtr_store_set(f->boot.st, key, prov, strlen(prov))) != DTR_OK) goto store_fail;
    } else {
        char p0[DTR__FAB_PROV];
        size_t len = 0;
        f->boot.waiting_for = 0;
        if ((r = dtr_store_get(f->boot.st, key, p0, sizeof p0 - 1, &len)) != DTR_OK) goto store_fail;
        p0[len < sizeof p0 ? len : sizeof p0 - 1] = 0;
        if (!strcmp(p0, "!")) {
            dtr__fab_free(f);
            return dtr__errf(err, errlen, DTR_UNSUPPORTED, "libfabric rank %d: rank 0 found no usable provider", f->rank);
        }
        if (prov[0] && strcmp(prov, p0) != 0) {
            r = dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                          "libfabric rank %d: this rank asks for provider '%s' but rank 0 uses '%s' "
                          "(every rank must name the same provider)", f->rank, prov, p0);
            dtr__fab_free(f);
            return r;
        }
        snprintf(prov, sizeof prov, "%s", p0);
    }
    snprintf(f->prov, sizeof f->prov, "%s", prov);

    /* 4. the endpoint */
    rc = dtr__fab_getinfo(prov, f->want_domain, f->local_size == f->size, &f->info);
    if (rc) {
        char avail[512];
        if (dtr_fabric_providers(avail, sizeof avail) != DTR_OK) snprintf(avail, sizeof avail, "none");
        for (i = 0; avail[i]; i++) if (avail[i] == '\n') avail[i] = ' ';
        r = dtr__errf(err, errlen, rc == -FI_ENODATA ? DTR_NOT_FOUND : DTR_IO_ERROR,
                      "libfabric rank %d: provider '%s' is not available with tagged reliable-datagram endpoints "
                      "(%s); available: %s", f->rank, prov, fi_strerror(-rc), avail);
        dtr__fab_free(f);
        return r;
    }
    f->inject = f->info->tx_attr ? f->info->tx_attr->inject_size : 0;
    {
        struct fi_cq_attr cqa;
        struct fi_av_attr ava;
        const char *step = "fi_fabric";
        memset(&cqa, 0, sizeof cqa);
        memset(&ava, 0, sizeof ava);
        cqa.format = FI_CQ_FORMAT_CONTEXT;
        cqa.wait_obj = FI_WAIT_NONE;
        cqa.size = 4096;
        ava.type = FI_AV_TABLE;
        ava.count = (size_t)f->size;
        rc = fi_fabric(f->info->fabric_attr, &f->fabric, NULL);
        if (!rc) { step = "fi_domain"; rc = fi_domain(f->fabric, f->info, &f->domain, NULL); }
        if (!rc) { step = "fi_cq_open"; rc = fi_cq_open(f->domain, &cqa, &f->cq, NULL); }
        if (!rc) { step = "fi_av_open"; rc = fi_av_open(f->domain, &ava, &f->av, NULL); }
        if (!rc) { step = "fi_endpoint"; rc = fi_endpoint(f->domain, f->info, &f->ep, NULL); }
        if (!rc && !strcmp(prov, "shm")) {
            char name[64];
            dtr__fab_shm_sweep();
            dtr__fab_shm_name(name, sizeof name);
            step = "fi_setname";
            rc = fi_setname(&f->ep->fid, name, strlen(name) + 1);
        }
        if (!rc) { step = "fi_ep_bind(cq)"; rc = fi_ep_bind(f->ep, &f->cq->fid, FI_TRANSMIT | FI_RECV); }
        if (!rc) { step = "fi_ep_bind(av)"; rc = fi_ep_bind(f->ep, &f->av->fid, 0); }
        if (!rc) { step = "fi_enable"; rc = fi_enable(f->ep); }
        if (rc) {
            r = dtr__errf(err, errlen, DTR_IO_ERROR, "libfabric rank %d: %s (provider %s, domain %s) failed: %s", f->rank,
                          step, prov, f->info->domain_attr->name, fi_strerror(-rc));
            dtr__fab_free(f);
            return r;
        }
    }
    {
        unsigned char name[DTR__FAB_ADDR], peer[DTR__FAB_ADDR];
        size_t nlen = sizeof name;
        rc = fi_getname(&f->ep->fid, name, &nlen);
        if (rc) {
            r = dtr__errf(err, errlen, DTR_IO_ERROR, "libfabric rank %d: fi_getname failed: %s", f->rank, fi_strerror(-rc));
            dtr__fab_free(f);
            return r;
        }
        if ((r = dtr__boot_publish(&f->boot, "addr", name, nlen)) != DTR_OK) goto store_fail;
        for (i = 0; i < f->size; i++) {
            size_t len = 0;
            if ((r = dtr__boot_fetch(&f->boot, "addr", i, peer, sizeof peer, &len)) != DTR_OK) goto store_fail;
            rc = fi_av_insert(f->av, peer, 1, &f->addrs[i], 0, NULL);
            if (rc != 1) {
                r = dtr__errf(err, errlen, DTR_IO_ERROR, "libfabric rank %d: the address of rank %d (%zu bytes) "
                              "cannot be inserted: %s", f->rank, i, len, fi_strerror(rc < 0 ? -rc : FI_EINVAL));
                dtr__fab_free(f);
                return r;
            }
        }
    }

    /* 5. the provider thread (from now on the only caller of libfabric), the watchdog */
    if (pthread_create(&f->thread, NULL, dtr__fab_thread, f) != 0) {
        dtr__fab_free(f);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "libfabric: cannot start the provider thread");
    }
    f->thread_on = 1;
    {
        dtr__watch_ops ops = {NULL, dtr__fab_wd_failed, dtr__fab_wd_to_publish, dtr__fab_wd_fail, dtr__fab_wd_left, NULL, NULL};
        if (f->isolate) ops.died = dtr__fab_wd_died;
        ops.check = dtr__fab_wd_check;
        ops.t = f;
        if (dtr__watchdog_start(&f->wd, &f->boot, &ops) != DTR_OK) {
            dtr__fab_free(f);
            return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "libfabric: cannot start the watchdog thread");
        }
    }
    if ((r = dtr__fab_hello(f, err, errlen)) != DTR_OK) {
        dtr__fab_close(f);
        return r;
    }
    info->rank = f->rank;
    info->size = f->size;
    snprintf(info->detail, sizeof info->detail, "%s", f->prov);
    info->local_rank = f->local_rank;
    info->local_size = f->local_size;
    *state = f;
    return DTR_OK;

store_fail:
    r = dtr__boot_fail(&f->boot, r, "exchanging addresses through the rendezvous store", err, errlen);
    dtr__fab_free(f);
    return r;
}

/* Stops the provider thread (then dtr__fab_free closes every libfabric object). After a failure of the
   world a thread that does not come back within 10 s is stuck inside the provider (shm
   spinning on a lock a killed peer held): it is left behind with the endpoint and the
   transport's state (never freed: the thread still uses them), and close returns. */
static int dtr__fab_stop_thread(dtr__fab *f) {
    int64_t until;
    int exited;
    if (!f->thread_on) return 1;
    pthread_mutex_lock(&f->mu);
    f->closing = 1;
    pthread_cond_signal(&f->work_cv);
    until = dtr__fab_aborted(f) ? dtr_time_ns() + (int64_t)10000 * 1000000 : -1;   /* no failure: a provider's close ends */
    while (!f->exited && !dtr__cond_wait_until(&f->done_cv, &f->mu, until)) {}
    exited = f->exited;
    pthread_mutex_unlock(&f->mu);
    if (exited) pthread_join(f->thread, NULL);
    else pthread_detach(f->thread);
    f->thread_on = 0;
    return exited;
}

static void dtr__fab_close(void *state) {
    dtr__fab *f = (dtr__fab *)state;
    if (!f) return;
    /* stops the watchdog, publishes an abort it had no time to, marks us as left */
    dtr__watchdog_stop(&f->wd);
    /* pending receives are cancelled, sends to dead peers let go, every object closed */
    if (dtr__fab_stop_thread(f)) dtr__fab_free(f);
}

/* cfg.fabric.keep_signal_handlers (or DTR_FABRIC_SIGNALS=keep): the handlers the process had
 * for the signals that libfabric's providers take over (shm: SIGSEGV, SIGBUS, SIGINT, SIGTERM
 * when its endpoint is made) are put back once the transport is open, whatever the outcome.
 * Default: the provider's handlers stay (shm removes its shared-memory files, then calls the
 * previous handler). */
static dtr_result dtr__fab_open(const dtr_comm_config *cfg, void **state, dtr_transport_info *info, char *err,
                                size_t errlen) {
    static const int sigs[6] = {SIGSEGV, SIGBUS, SIGINT, SIGTERM, SIGABRT, SIGILL};
    struct sigaction saved[6];
    const char *env = getenv("DTR_FABRIC_SIGNALS");
    int keep = cfg->fabric.keep_signal_handlers == 1 || (cfg->fabric.keep_signal_handlers == 0 && env && !strcmp(env, "keep")), i;
    dtr_result r;
    for (i = 0; keep && i < 6; i++) sigaction(sigs[i], NULL, &saved[i]);
    r = dtr__fab_open_ep(cfg, state, info, err, errlen);
    for (i = 0; keep && i < 6; i++) sigaction(sigs[i], &saved[i], NULL);
    return r;
}

static const dtr_transport_vtable dtr__fab_vtable = {
    DTR_VERSION_NUMBER,
    "libfabric",
    dtr__fab_open,
    dtr__fab_close,
    dtr__fab_isend,
    dtr__fab_irecv,
    dtr__fab_test,
    dtr__fab_wait_any,
    dtr__fab_release,
    dtr__fab_abort,
    NULL,   /* progress: the provider thread makes it */
    NULL, NULL, NULL, NULL, NULL, NULL, NULL,
    DTR_MEM_HOST,   /* host buffers (device memory would need FI_HMEM registration) */
    dtr__fab_peer_alive,
    dtr__fab_wait_some
};

const dtr_transport_vtable *dtr_fabric_transport(void) { return &dtr__fab_vtable; }

#else /* !DTR_USE_LIBFABRIC */

dtr_result dtr_fabric_providers(char *buf, size_t len) {
    if (buf && len) buf[0] = 0;
    return DTR_UNSUPPORTED;
}

const dtr_transport_vtable *dtr_fabric_transport(void) { return NULL; }

#endif
