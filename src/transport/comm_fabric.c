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

typedef struct dtr__freq {
    struct fi_context2 ctx;      /* first: the provider's per-operation context */
    int stage;                   /* DTR__FQ_*: receives of application messages go HDR, then BODY or TRASH */
    int repost;                  /* the payload receive could not be posted yet (queue full) */
    uint64_t hdr;                /* the header received: the payload's length */
    uint64_t tag;
    void *buf;
    void *trash;                 /* scratch for a payload longer than buf */
    int peer, is_recv;
    int done;                    /* the completion arrived (or it never needed one) */
    int released;                /* released while pending: recycled when its completion arrives */
    dtr_result result;
    int native;
    size_t bytes;
    char msg[160];
    struct dtr__freq *next_free, *next_all;
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
    struct fid_ep *ep;
    fi_addr_t *addrs;
    size_t inject;
    int64_t spin_ns;             /* wait_any polls this long, then naps */
    const char *want_domain;     /* cfg.fabric.domain or $DTR_FABRIC_DOMAIN; NULL: the provider's first */
    int64_t max_nap_ns;          /* the longest nap */
    int64_t timeout_ns;          /* the group's deadline setting: bounds retries of full queues */
    int reposts;                 /* requests with repost set */
    dtr__boot boot;              /* the store connection, namespace, hosts and pids (src/comm/bootstrap.c) */
    int *left;                   /* per peer: closed cleanly (its requests fail, "rank N left") */
    /* requests and the completion queue, under mu */
    pthread_mutex_t mu;
    dtr__freq *free_reqs, *all_reqs;
    /* world failure, under mu; `aborted` is also read without the lock as a hint */
    volatile int aborted;
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

static void dtr__fab_sleep_ns(int64_t ns) {
    struct timespec ts;
    if (ns <= 0) return;
    ts.tv_sec = (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    nanosleep(&ts, NULL);
}

/* Marks the world failed (lock held). Returns 1 when this call did it. */
static int dtr__fab_fail_locked(dtr__fab *f, int rank, int publish, const char *fmt, ...) DTR__PRINTF(4, 5);
static int dtr__fab_fail_locked(dtr__fab *f, int rank, int publish, const char *fmt, ...) {
    va_list ap;
    if (f->aborted) return 0;
    f->failed_rank = rank;
    va_start(ap, fmt);
    vsnprintf(f->why, sizeof f->why, fmt, ap);
    va_end(ap);
    f->publish = publish;
    f->aborted = 1;
    return 1;
}

static void dtr__fab_wake_watchdog(dtr__fab *f) { dtr__watchdog_wake(&f->wd); }

/* ---- requests ---- */

static dtr__freq *dtr__freq_get(dtr__fab *f, int peer, int is_recv, size_t bytes) {
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
    q->repost = 0;
    q->hdr = 0;
    q->tag = 0;
    q->buf = NULL;
    q->trash = NULL;
    q->peer = peer;
    q->is_recv = is_recv;
    q->done = 0;
    q->released = 0;
    q->result = DTR_OK;
    q->native = 0;
    q->bytes = bytes;
    q->msg[0] = 0;
    q->next_free = NULL;
    return q;
}

static void dtr__freq_put(dtr__fab *f, dtr__freq *q) {
    q->next_free = f->free_reqs;
    f->free_reqs = q;
}

static void dtr__freq_complete(dtr__fab *f, dtr__freq *q) {
    if (q->trash) { dtr__free(&f->alloc, q->trash); q->trash = NULL; }
    if (q->repost) { q->repost = 0; f->reposts--; }
    q->done = 1;
    if (q->released) dtr__freq_put(f, q);
}

/* Posts the payload receive of an application message whose header arrived (lock held). */
static void dtr__freq_post_body(dtr__fab *f, dtr__freq *q) {
    ssize_t rc;
    size_t len = (size_t)q->hdr;
    void *dst = q->buf;
    if (q->hdr > (uint64_t)q->bytes) {
        if (!q->trash) q->trash = dtr__malloc(&f->alloc, len ? len : 1);
        if (!q->trash) {
            q->result = DTR_OUT_OF_MEMORY;
            snprintf(q->msg, sizeof q->msg, "out of memory for the %llu bytes of a too long message from rank %d",
                     (unsigned long long)q->hdr, q->peer);
            dtr__freq_complete(f, q);   /* the payload stays queued: the group is unusable */
            return;
        }
        dst = q->trash;
    }
    rc = f->ep ? fi_trecv(f->ep, dst, len, NULL, f->addrs[q->peer], q->tag, 0, &q->ctx) : -FI_ECANCELED;
    if (rc == -FI_EAGAIN) {
        if (!q->repost) { q->repost = 1; f->reposts++; }
        return;
    }
    if (q->repost) { q->repost = 0; f->reposts--; }
    if (rc) {
        q->result = DTR_PEER_FAILED;
        snprintf(q->msg, sizeof q->msg, "posting the receive of a message from rank %d failed: %s", q->peer,
                 fi_strerror((int)-rc));
        dtr__freq_complete(f, q);
        return;
    }
    q->stage = q->trash ? DTR__FQ_TRASH : DTR__FQ_BODY;
}

/* A successful completion of q's current operation (lock held). */
static void dtr__freq_event(dtr__fab *f, dtr__freq *q) {
    if (q->stage == DTR__FQ_HDR && !q->released) {
        dtr__freq_post_body(f, q);
        return;
    }
    if (q->stage == DTR__FQ_TRASH) {
        q->result = DTR_INVALID_ARGUMENT;
        snprintf(q->msg, sizeof q->msg, "a message of %llu bytes from rank %d is longer than the receive buffer of %zu bytes",
                 (unsigned long long)q->hdr, q->peer, q->bytes);
    }
    dtr__freq_complete(f, q);
}

/* Reads the completion queue dry (lock held). A fatal queue error breaks the world. */
static void dtr__fab_poll(dtr__fab *f) {
    struct fi_cq_entry ev[16];
    if (f->reposts) {
        dtr__freq *q;
        for (q = f->all_reqs; q; q = q->next_all)
            if (q->repost) dtr__freq_post_body(f, q);
    }
    for (;;) {
        ssize_t n = fi_cq_read(f->cq, ev, 16), i;
        if (n > 0) {
            for (i = 0; i < n; i++) dtr__freq_event(f, (dtr__freq *)ev[i].op_context);
            if (n < 16) return;
            continue;
        }
        if (n == -FI_EAGAIN) return;
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry e;
            dtr__freq *q;
            int code;
            memset(&e, 0, sizeof e);
            if (fi_cq_readerr(f->cq, &e, 0) <= 0) return;
            q = (dtr__freq *)e.op_context;
            if (!q) continue;
            code = e.err < 0 ? -e.err : e.err;   /* shm reports it negative */
            if (code == FI_ETRUNC) {
                q->result = DTR_INVALID_ARGUMENT;
                snprintf(q->msg, sizeof q->msg, "a message from rank %d is longer than the receive buffer of %zu bytes",
                         q->peer, q->bytes);
            } else if (code == FI_ECANCELED) {
                q->result = DTR_PEER_FAILED;
                if (f->left[q->peer])
                    snprintf(q->msg, sizeof q->msg, "rank %d left (closed its group) while this rank %s it", q->peer,
                             q->is_recv ? "waited for a message from" : "sent to");
                else
                    snprintf(q->msg, sizeof q->msg, "the %s rank %d was cancelled",
                             q->is_recv ? "receive from" : "send to", q->peer);
            } else {
                q->result = DTR_PEER_FAILED;
                snprintf(q->msg, sizeof q->msg, "%s rank %d failed: %s (libfabric %s, error %d)",
                         q->is_recv ? "receiving from" : "sending to", q->peer,
                         fi_cq_strerror(f->cq, e.prov_errno, e.err_data, NULL, 0), f->prov, code);
            }
            q->native = -code;
            dtr__freq_complete(f, q);
            continue;
        }
        /* the queue itself failed: nothing will complete any more */
        dtr__fab_fail_locked(f, f->rank, 1, "rank %d: reading the completion queue failed: %s", f->rank,
                             fi_strerror((int)-n));
        return;
    }
}

/* Closes the endpoint once the world has failed (lock held): the provider lets go of every
   buffer. Later posts fail with the world's error; the completion queue stays readable. */
static void dtr__fab_close_ep(dtr__fab *f) {
    if (!f->ep) return;
    fi_close(&f->ep->fid);
    f->ep = NULL;
}

/* 1 when the caller may stop waiting for q (lock held): it is complete, its peer left, or
   the world failed. */
static int dtr__freq_finished(const dtr__fab *f, const dtr__freq *q) {
    return q->done || f->left[q->peer] || f->aborted;
}

/* The result of a finished request (lock held). */
static dtr_result dtr__freq_result(dtr__fab *f, dtr__freq *q, dtr_transport_error *err) {
    if (q->done) {
        if (q->result != DTR_OK) dtr__ferr(err, q->peer, q->native, "%s", q->msg);
        return q->result;
    }
    if (f->left[q->peer] && !f->aborted) {
        dtr__ferr(err, q->peer, 0, "rank %d left (closed its group) while this rank %s it", q->peer,
                  q->is_recv ? "waited for a message from" : "sent to");
        return DTR_PEER_FAILED;
    }
    dtr__ferr(err, f->failed_rank, 0, "rank %d failed: %s", f->failed_rank, f->why);
    return DTR_PEER_FAILED;
}

static dtr_result dtr__fab_post(dtr__fab *f, int is_recv, void *buf, size_t bytes, int peer, uint64_t tag, void **req,
                                dtr_transport_error *err) {
    dtr__freq *q;
    ssize_t rc;
    int64_t give_up = 0;
    int hdr, sent_hdr = 0;
    *req = NULL;
    if (peer < 0 || peer >= f->size) {
        dtr__ferr(err, -1, 0, "rank %d outside the world of %d", peer, f->size);
        return DTR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&f->mu);
    q = dtr__freq_get(f, peer, is_recv, bytes);
    if (!q) {
        pthread_mutex_unlock(&f->mu);
        dtr__ferr(err, -1, 0, "out of memory");
        return DTR_OUT_OF_MEMORY;
    }
    hdr = (tag & DTR__TAG_P2P) && f->inject >= sizeof q->hdr;
    q->tag = tag;
    q->buf = buf;
    for (;;) {
        if (f->aborted || f->left[peer] || !f->ep) {
            dtr_result r = dtr__freq_result(f, q, err);   /* q is not done: the world's or the peer's error */
            dtr__freq_put(f, q);
            pthread_mutex_unlock(&f->mu);
            return r;
        }
        if (is_recv && hdr) {
            rc = fi_trecv(f->ep, &q->hdr, sizeof q->hdr, NULL, f->addrs[peer], tag | DTR__FAB_HDR, 0, &q->ctx);
            if (rc == 0) q->stage = DTR__FQ_HDR;
        } else if (is_recv)
            rc = fi_trecv(f->ep, buf, bytes, NULL, f->addrs[peer], tag, 0, &q->ctx);
        else if (hdr && !sent_hdr) {
            uint64_t len = (uint64_t)bytes;
            rc = fi_tinject(f->ep, &len, sizeof len, f->addrs[peer], tag | DTR__FAB_HDR);
            if (rc == 0) { sent_hdr = 1; continue; }
        } else if (bytes <= f->inject)
            rc = fi_tinject(f->ep, buf, bytes, f->addrs[peer], tag);
        else
            rc = fi_tsend(f->ep, buf, bytes, NULL, f->addrs[peer], tag, &q->ctx);
        if (rc != -FI_EAGAIN) break;
        /* the queues are full: make progress and retry, for a bounded time */
        dtr__fab_poll(f);
        if (!give_up) give_up = dtr_time_ns() + f->timeout_ns;
        else if (dtr_time_ns() > give_up) break;
        pthread_mutex_unlock(&f->mu);
        dtr__fab_sleep_ns(2000);
        pthread_mutex_lock(&f->mu);
    }
    if (rc != 0) {
        dtr__freq_put(f, q);
        pthread_mutex_unlock(&f->mu);
        if (rc == -FI_EAGAIN)
            dtr__ferr(err, peer, (int)rc, "the %s rank %d could not be posted within %lld ms: the provider's queues "
                      "stay full", is_recv ? "receive from" : "send to", peer, (long long)(f->timeout_ns / 1000000));
        else
            dtr__ferr(err, peer, (int)rc, "posting a %s rank %d failed: %s", is_recv ? "receive from" : "send to", peer,
                      fi_strerror((int)-rc));
        return DTR_PEER_FAILED;
    }
    if (!is_recv && bytes <= f->inject) q->done = 1;   /* injected: the buffer is free already */
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
    if (!q->done) dtr__fab_poll(f);
    *done = dtr__freq_finished(f, q);
    if (*done) r = dtr__freq_result(f, q, err);
    pthread_mutex_unlock(&f->mu);
    return r;
}

/* Naps of a few microseconds need the thread's timer slack (50 us by default on Linux) cut
   to 1 us while this thread waits; it is put back on return. */
static long dtr__fab_slack_begin(void) {
#ifdef __linux__
    long old = (long)prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    if (old > 1000) prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    return old;
#else
    return 0;
#endif
}
static void dtr__fab_slack_end(long old) {
#ifdef __linux__
    if (old > 1000) prctl(PR_SET_TIMERSLACK, (unsigned long)old, 0, 0, 0);
#else
    (void)old;
#endif
}

static dtr_result dtr__fab_wait_any(void *state, void *const *reqs, int n, int64_t deadline_ns,
                                    dtr_transport_error *err) {
    dtr__fab *f = (dtr__fab *)state;
    int64_t now = dtr_time_ns(), spin_until = now + f->spin_ns, nap = 4000;
    long slack = -1;
    dtr_result r = DTR_OK;
    for (;;) {
        int i, pending = -1;
        pthread_mutex_lock(&f->mu);
        dtr__fab_poll(f);
        for (i = 0; i < n; i++) {
            dtr__freq *q = (dtr__freq *)reqs[i];
            if (!q) continue;
            if (dtr__freq_finished(f, q)) { pthread_mutex_unlock(&f->mu); goto out; }
            if (pending < 0) pending = i;
        }
        if (pending < 0) { pthread_mutex_unlock(&f->mu); goto out; }
        if (f->aborted) {
            dtr__ferr(err, f->failed_rank, 0, "rank %d failed: %s", f->failed_rank, f->why);
            pthread_mutex_unlock(&f->mu);
            r = DTR_PEER_FAILED;
            goto out;
        }
        pthread_mutex_unlock(&f->mu);
        now = dtr_time_ns();
        if (now >= deadline_ns) {
            const dtr__freq *q = (const dtr__freq *)reqs[pending];
            dtr__ferr(err, q->peer, 0, "rank %d did not %s (%zu bytes) in time", q->peer,
                      q->is_recv ? "send the message this rank waits for" : "take the message this rank sends", q->bytes);
            r = DTR_TIMEOUT;
            goto out;
        }
        if (now < spin_until) continue;
        /* then naps, short at first: a thread computing beside us (the application's, while
           the group's progress thread waits for a gradient bucket) keeps the core */
        if (slack < 0) slack = dtr__fab_slack_begin();
        dtr__fab_sleep_ns(nap < deadline_ns - now ? nap : deadline_ns - now);
        if (nap < f->max_nap_ns) nap *= 2;
    }
out:
    if (slack >= 0) dtr__fab_slack_end(slack);
    return r;
}

static void dtr__fab_release(void *state, void *req) {
    dtr__fab *f = (dtr__fab *)state;
    dtr__freq *q = (dtr__freq *)req;
    int64_t until;
    if (!q) return;
    pthread_mutex_lock(&f->mu);
    if (q->done) {
        dtr__freq_put(f, q);
        pthread_mutex_unlock(&f->mu);
        return;
    }
    /* pending: cancel it and give the cancellation a moment to complete, so that the buffer
       is not touched after release returns; a request the provider cannot cancel (a send
       already under way to a dead peer) stays owned by the transport until close */
    q->released = 1;
    if (f->ep) fi_cancel(&f->ep->fid, &q->ctx);
    until = dtr_time_ns() + 100000000;
    while (!q->done && dtr_time_ns() < until) {
        dtr__fab_poll(f);
        if (q->done) break;
        pthread_mutex_unlock(&f->mu);
        dtr__fab_sleep_ns(20000);
        pthread_mutex_lock(&f->mu);
    }
    /* once done, dtr__freq_complete recycled it (released was set). A request the provider
       would not give back may still use its buffer, which belongs to the caller again: break
       the world and close the endpoint, after which the provider touches no buffer. */
    if (!q->done) {
        if (dtr__fab_fail_locked(f, f->rank, 1, "rank %d could not cancel a pending %s rank %d (%zu bytes)", f->rank,
                                 q->is_recv ? "receive from" : "send to", q->peer, q->bytes))
            dtr__fab_wake_watchdog(f);
        dtr__fab_close_ep(f);
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

static dtr_result dtr__fab_progress(void *state) {
    dtr__fab *f = (dtr__fab *)state;
    pthread_mutex_lock(&f->mu);
    dtr__fab_poll(f);
    pthread_mutex_unlock(&f->mu);
    return DTR_OK;
}

/* ---- the watchdog's callbacks (the watchdog itself: src/comm/watchdog.c) ---- */

static int dtr__fab_wd_failed(void *t) { return ((dtr__fab *)t)->aborted; }

static int dtr__fab_wd_to_publish(void *t, int *who, char *why, size_t cap) {
    dtr__fab *f = (dtr__fab *)t;
    int mine;
    pthread_mutex_lock(&f->mu);
    mine = f->aborted && f->publish;
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

/* A peer closed cleanly: what it sent before is here (read it first); requests still
   waiting for it fail, their receives cancelled. */
static void dtr__fab_wd_left(void *t, int p) {
    dtr__fab *f = (dtr__fab *)t;
    dtr__freq *q;
    pthread_mutex_lock(&f->mu);
    dtr__fab_poll(f);
    f->left[p] = 1;
    for (q = f->all_reqs; q; q = q->next_all)
        if (f->ep && q->peer == p && !q->done && !q->released && q->is_recv) fi_cancel(&f->ep->fid, &q->ctx);
    dtr__fab_poll(f);
    pthread_mutex_unlock(&f->mu);
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
    f->boot.failed = f->aborted;   /* bounded teardown after a failure (grace_ms) */
    dtr__boot_close(&f->boot);
    dtr__free(&f->alloc, f->addrs);
    dtr__free(&f->alloc, f->left);
    dtr__watchdog_free(&f->wd);
    pthread_mutex_destroy(&f->mu);
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
    f->spin_ns = dtr__fab_setting(cfg->fabric.spin_us, "DTR_FABRIC_SPIN_US", 20) * 1000;
    f->max_nap_ns = dtr__fab_setting(cfg->fabric.nap_us, "DTR_FABRIC_NAP_US", 64) * 1000;
    f->want_domain = cfg->fabric.domain && *cfg->fabric.domain ? cfg->fabric.domain : getenv("DTR_FABRIC_DOMAIN");
    if (f->max_nap_ns < 1000) f->max_nap_ns = 1000;
    f->timeout_ns = (int64_t)timeout * 1000000;
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
    if (!f->addrs || !f->left) {
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

    /* 5. the watchdog */
    {
        dtr__watch_ops ops = {NULL, dtr__fab_wd_failed, dtr__fab_wd_to_publish, dtr__fab_wd_fail, dtr__fab_wd_left};
        ops.t = f;
        if (dtr__watchdog_start(&f->wd, &f->boot, &ops) != DTR_OK) {
            dtr__fab_free(f);
            return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "libfabric: cannot start the watchdog thread");
        }
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

static void dtr__fab_close(void *state) {
    dtr__fab *f = (dtr__fab *)state;
    if (!f) return;
    /* stops the watchdog, publishes an abort it had no time to, marks us as left */
    dtr__watchdog_stop(&f->wd);
    /* pending requests are cancelled; then the endpoint closes */
    pthread_mutex_lock(&f->mu);
    {
        dtr__freq *q;
        for (q = f->all_reqs; q; q = q->next_all)
            if (f->ep && !q->done && q->is_recv) fi_cancel(&f->ep->fid, &q->ctx);
        if (f->aborted) dtr__fab_close_ep(f);   /* sends to dead peers: let go of their buffers now */
        dtr__fab_poll(f);
    }
    pthread_mutex_unlock(&f->mu);
    dtr__fab_free(f);
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
    dtr__fab_progress,
    NULL, NULL, NULL, NULL, NULL, NULL, NULL,
    DTR_MEM_HOST   /* host buffers (device memory would need FI_HMEM registration) */
};

const dtr_transport_vtable *dtr_fabric_transport(void) { return &dtr__fab_vtable; }

#else /* !DTR_USE_LIBFABRIC */

dtr_result dtr_fabric_providers(char *buf, size_t len) {
    if (buf && len) buf[0] = 0;
    return DTR_UNSUPPORTED;
}

const dtr_transport_vtable *dtr_fabric_transport(void) { return NULL; }

#endif
