/* ============================================================================
 * Rendezvous, part 4 of 4: the store's client, which every rank (rank 0 included) uses with
 * one blocking-with-deadline connection, and dtr_store_create, which starts rank 0's server
 * (server.c) first. On Windows the store reports DTR_UNSUPPORTED.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_rdzv.h"
#include "../core/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)

/* ---- Windows: not supported yet ---- */

struct dtr_store {
    int unused;
};

dtr_result dtr_store_create(const dtr_rendezvous_config *cfg, dtr_store **out, char *err, size_t errlen) {
    (void)cfg;
    if (out) *out = NULL;
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "rendezvous: the TCP store needs POSIX sockets (not on Windows yet)");
}
void dtr_store_destroy(dtr_store *st) { (void)st; }
void dtr_store_mark_failed(dtr_store *st) { (void)st; }
dtr_result dtr_store_set(dtr_store *st, const char *key, const void *value, size_t len) {
    (void)st; (void)key; (void)value; (void)len;
    return DTR_UNSUPPORTED;
}
dtr_result dtr_store_get(dtr_store *st, const char *key, void *buf, size_t cap, size_t *len) {
    (void)st; (void)key; (void)buf; (void)cap; (void)len;
    return DTR_UNSUPPORTED;
}
dtr_result dtr_store_check(dtr_store *st, const char *key, void *buf, size_t cap, size_t *len, int *found) {
    (void)st; (void)key; (void)buf; (void)cap; (void)len; (void)found;
    return DTR_UNSUPPORTED;
}
dtr_result dtr_store_add(dtr_store *st, const char *key, int64_t delta, int64_t *result) {
    (void)st; (void)key; (void)delta; (void)result;
    return DTR_UNSUPPORTED;
}
dtr_result dtr_store_delete(dtr_store *st, const char *key) {
    (void)st; (void)key;
    return DTR_UNSUPPORTED;
}
dtr_result dtr_store_barrier(dtr_store *st, const char *tag) {
    (void)st; (void)tag;
    return DTR_UNSUPPORTED;
}
dtr_result dtr__store_clone(const dtr_store *st, int timeout_ms, dtr_store **out, char *err, size_t errlen) {
    (void)st; (void)timeout_ms;
    if (out) *out = NULL;
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "rendezvous: the TCP store needs POSIX sockets (not on Windows yet)");
}
void dtr__store_set_timeout(dtr_store *st, int timeout_ms) { (void)st; (void)timeout_ms; }
void dtr__store_cut(dtr_store *st) { (void)st; }
const char *dtr_store_last_error(const dtr_store *st) { (void)st; return "rendezvous: not supported on Windows"; }
int32_t dtr_store_rank(const dtr_store *st) { (void)st; return -1; }
int32_t dtr_store_world_size(const dtr_store *st) { (void)st; return 0; }
int dtr_store_port(const dtr_store *st) { (void)st; return 0; }

#else /* POSIX */

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/types.h>

/* ---- the client ---- */

struct dtr_store {
    dtr_rendezvous_config cfg;
    int fd;
    dtr_result broken;           /* DTR_OK while the connection is usable */
    char broken_msg[256];
    uint32_t next_id;
    int64_t barriers;            /* barriers passed */
    int port;
    char where[DTR_RDZV_STR + 16];   /* "host:port" of the server */
    pthread_mutex_t lock;
    dtr__rdzv_host *host;        /* rank 0: the server */
    int failed;                  /* the job failed: destroy waits grace_ms at most (atomic) */
    int64_t cut;                 /* dtr__store_cut: every call ends by this time (ms; 0: never; atomic) */
    char err[768];
};

/* The poll wait of a call with `deadline`, at most 100 ms at a time while a cut may come (cut
 * non-NULL): 0 once the deadline or the cut has passed. */
static int dtr__rdzv_wait_ms(int64_t deadline, const int64_t *cut) {
    int64_t c = cut ? DTR__ATOMIC_LOAD(cut) : 0;
    int left = dtr__rdzv_left_ms(c > 0 && c < deadline ? c : deadline);
    return cut && left > 100 ? 100 : left;
}

/* Sends all n bytes before the deadline (and the store's cut, when given). DTR_TIMEOUT or
 * DTR_PEER_FAILED (errno in *e). */
static dtr_result dtr__rdzv_send_cut(int fd, const void *buf, size_t n, int64_t deadline, const int64_t *cut, int *e) {
    const uint8_t *p = (const uint8_t *)buf;
    *e = 0;
    while (n > 0) {
        ssize_t k = send(fd, p, n, DTR__RDZV_NOSIGNAL);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pf;
            int left = dtr__rdzv_wait_ms(deadline, cut), rc;
            if (left == 0) return DTR_TIMEOUT;
            pf.fd = fd;
            pf.events = POLLOUT;
            pf.revents = 0;
            rc = poll(&pf, 1, left);
            if (rc < 0 && errno != EINTR) {
                *e = errno;
                return DTR_PEER_FAILED;
            }
            continue;
        }
        *e = k < 0 ? errno : 0;
        return DTR_PEER_FAILED;
    }
    return DTR_OK;
}

/* Receives exactly n bytes before the deadline; *got counts what arrived. DTR_PEER_FAILED
 * with *e == 0 means the peer closed the connection. */
static dtr_result dtr__rdzv_recv_cut(int fd, void *buf, size_t n, int64_t deadline, const int64_t *cut, size_t *got,
                                     int *e) {
    uint8_t *p = (uint8_t *)buf;
    *got = 0;
    *e = 0;
    while (*got < n) {
        ssize_t k = recv(fd, p + *got, n - *got, 0);
        if (k > 0) {
            *got += (size_t)k;
            continue;
        }
        if (k == 0) return DTR_PEER_FAILED;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            struct pollfd pf;
            int left = dtr__rdzv_wait_ms(deadline, cut), rc;
            if (left == 0) return DTR_TIMEOUT;
            pf.fd = fd;
            pf.events = POLLIN;
            pf.revents = 0;
            rc = poll(&pf, 1, left);
            if (rc < 0 && errno != EINTR) {
                *e = errno;
                return DTR_PEER_FAILED;
            }
            continue;
        }
        *e = errno;
        return DTR_PEER_FAILED;
    }
    return DTR_OK;
}

/* Without a cut (the connection's handshake; the federated protocol). */
static dtr_result dtr__rdzv_send_all(int fd, const void *buf, size_t n, int64_t deadline, int *e) {
    return dtr__rdzv_send_cut(fd, buf, n, deadline, NULL, e);
}
static dtr_result dtr__rdzv_recv_all(int fd, void *buf, size_t n, int64_t deadline, size_t *got, int *e) {
    return dtr__rdzv_recv_cut(fd, buf, n, deadline, NULL, got, e);
}

static const char *dtr__rdzv_errno_str(int e) { return e ? strerror(e) : "connection closed by the server"; }

/* Records the store's message (and logs it at ERROR); returns code. */
static dtr_result dtr__rdzv_fail(dtr_store *st, dtr_result code, const char *fmt, ...) DTR__PRINTF(3, 4);
static dtr_result dtr__rdzv_fail(dtr_store *st, dtr_result code, const char *fmt, ...) {
    if (code == DTR_TIMEOUT || code == DTR_PEER_FAILED) DTR__ATOMIC_STORE(&st->failed, 1);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->err, sizeof st->err, fmt, ap);
    va_end(ap);
    dtr__rdzv_log(&st->cfg, DTR_LOG_ERROR, "%s", st->err);
    return code;
}

/* The message and code of a refused join (status != W_OK); `gen` is the server's generation. */
static dtr_result dtr__rdzv_refusal(const dtr_store *st, uint32_t status, uint32_t gen, char *why, size_t whylen) {
    long mine = (long)st->cfg.generation;
    switch (status) {
    case DTR__RDZV_W_BAD_SECRET:
        return dtr__errf(why, whylen, DTR_INVALID_ARGUMENT,
                         "the server refused the secret (DTR_SECRET must be the same on every rank)");
    case DTR__RDZV_W_BAD_RANK:
        return dtr__errf(why, whylen, DTR_INVALID_ARGUMENT,
                         "the server refused rank %ld of a world of %ld (rank 0 has another world size)",
                         (long)st->cfg.rank, (long)st->cfg.world_size);
    case DTR__RDZV_W_STALE:
        return dtr__errf(why, whylen, DTR_INVALID_ARGUMENT,
                         "this rank is of generation %ld but the store is generation %lu: the job was restarted "
                         "and this rank belongs to an old world (DTR_RESTART)", mine, (unsigned long)gen);
    case DTR__RDZV_W_OLD_SERVER:
        return dtr__errf(why, whylen, DTR_PEER_FAILED,
                         "the store there is of generation %lu, an older world than this rank's %ld (still going "
                         "away?)", (unsigned long)gen, mine);
    case DTR__RDZV_W_OTHER_JOB:
        return dtr__errf(why, whylen, DTR_INVALID_ARGUMENT,
                         "another job owns the store on this port (its job id is not '%.64s'; two jobs on one "
                         "port: give each its own DTR_MASTER_PORT)", st->cfg.job_id);
    default:
        return dtr__errf(why, whylen, DTR_VERSION_MISMATCH, "the server refused this protocol version");
    }
}

/* Connect (non-blocking, bounded by the deadline) and run the client side of the handshake.
 * Returns DTR_OK, or the error with the reason in why; *fatal says whether retrying is
 * pointless (refused secret, rank, version). */
static dtr_result dtr__rdzv_join(dtr_store *st, const dtr__rdzv_addr *a, int64_t deadline, int *fd_out, char *why,
                                 size_t whylen, int *fatal) {
    uint8_t hello[DTR__RDZV_HELLO_LEN], auth[DTR__RDZV_AUTH_LEN], wel[DTR__RDZV_WELCOME_LEN], mac[DTR__RDZV_MAC];
    size_t got;
    int fd, e = 0, one = 1;
    uint32_t status;
    dtr_result r;
    int64_t cdl = dtr__rdzv_now_ms() + 5000;   /* one address may be a black hole: try the next */
    *fatal = 0;
    *fd_out = -1;
    if (cdl > deadline) cdl = deadline;
    fd = socket(a->ss.ss_family, SOCK_STREAM, 0);
    if (fd < 0) return dtr__errf(why, whylen, DTR_IO_ERROR, "socket: %s", strerror(errno));
    if (!dtr__rdzv_nonblock(fd)) {
        close(fd);
        return dtr__errf(why, whylen, DTR_IO_ERROR, "fcntl: %s", strerror(errno));
    }
    dtr__rdzv_sockopts(fd);
    (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, (socklen_t)sizeof one);
    if (connect(fd, (const struct sockaddr *)(const void *)&a->ss, a->len) != 0) {
        if (errno != EINPROGRESS && errno != EINTR) {
            e = errno;
            close(fd);
            return dtr__errf(why, whylen, DTR_PEER_FAILED, "connect: %s", strerror(e));
        }
        for (;;) {
            struct pollfd pf;
            int rc, left = dtr__rdzv_left_ms(cdl);
            socklen_t sl = (socklen_t)sizeof e;
            if (left == 0) {
                close(fd);
                return dtr__errf(why, whylen, DTR_TIMEOUT, "connect: no answer");
            }
            pf.fd = fd;
            pf.events = POLLOUT;
            pf.revents = 0;
            rc = poll(&pf, 1, left);
            if (rc < 0 && errno == EINTR) continue;
            if (rc == 0) continue;
            e = 0;
            if (rc < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &sl) != 0) e = errno;
            if (e != 0) {
                close(fd);
                return dtr__errf(why, whylen, DTR_PEER_FAILED, "connect: %s", strerror(e));
            }
            break;
        }
    }
    /* hello */
    r = dtr__rdzv_recv_all(fd, hello, sizeof hello, deadline, &got, &e);
    if (r != DTR_OK) {
        close(fd);
        return dtr__errf(why, whylen, r, "waiting for the server's greeting: %s",
                         r == DTR_TIMEOUT ? "no answer" : dtr__rdzv_errno_str(e));
    }
    if (memcmp(hello, "DTRZ", 4) != 0) {
        close(fd);
        *fatal = 1;
        return dtr__errf(why, whylen, DTR_PEER_FAILED, "the server is not a dtrain rendezvous server (bad greeting)");
    }
    if (dtr__rdzv_get32(hello + 4) != DTR__RDZV_VERSION) {
        close(fd);
        *fatal = 1;
        return dtr__errf(why, whylen, DTR_VERSION_MISMATCH, "the server speaks protocol version %lu, this rank %u",
                         (unsigned long)dtr__rdzv_get32(hello + 4), DTR__RDZV_VERSION);
    }
    /* auth */
    memcpy(auth, "DTRA", 4);
    dtr__rdzv_put32(auth + 4, DTR__RDZV_VERSION);
    dtr__rdzv_put32(auth + 8, (uint32_t)st->cfg.rank);
    dtr__rdzv_put32(auth + 12, (uint32_t)st->cfg.world_size);
    dtr__rdzv_put32(auth + 16, (uint32_t)st->cfg.generation);
    dtr__rdzv_job_tag(st->cfg.job_id, auth + 20);
    dtr__rdzv_random(auth + DTR__RDZV_AUTH_NONCE, DTR__RDZV_NONCE);
    dtr__rdzv_auth_mac(st->cfg.secret, hello + 8, auth, auth + DTR__RDZV_AUTH_SIGNED);
    r = dtr__rdzv_send_all(fd, auth, sizeof auth, deadline, &e);
    if (r == DTR_OK) r = dtr__rdzv_recv_all(fd, wel, sizeof wel, deadline, &got, &e);
    if (r != DTR_OK) {
        close(fd);
        return dtr__errf(why, whylen, r, "during the handshake: %s",
                         r == DTR_TIMEOUT ? "no answer" : dtr__rdzv_errno_str(e));
    }
    status = dtr__rdzv_get32(wel + 4);
    if (memcmp(wel, "DTRW", 4) != 0 || status > DTR__RDZV_W_OTHER_JOB) {
        close(fd);
        *fatal = 1;
        return dtr__errf(why, whylen, DTR_PEER_FAILED, "malformed answer to the join message");
    }
    if (status != DTR__RDZV_W_OK) {
        close(fd);
        *fatal = status != DTR__RDZV_W_OLD_SERVER;   /* an older store goes away: retry */
        return dtr__rdzv_refusal(st, status, dtr__rdzv_get32(wel + 8), why, whylen);
    }
    dtr__rdzv_welcome_mac(st->cfg.secret, auth + DTR__RDZV_AUTH_NONCE, hello + 8, wel, mac);
    if (!dtr__ct_equal(mac, wel + DTR__RDZV_WELCOME_SIGNED, DTR__RDZV_MAC)) {
        close(fd);
        *fatal = 1;
        return dtr__errf(why, whylen, DTR_INVALID_ARGUMENT,
                         "the server did not prove that it knows the secret (a different DTR_SECRET, or not our server)");
    }
    *fd_out = fd;
    return DTR_OK;
}

/* Resolves and joins, retrying until the deadline while the server is not up. */
static dtr_result dtr__rdzv_connect(dtr_store *st, int64_t deadline, char *err, size_t errlen) {
    dtr__rdzv_addr addrs[DTR__RDZV_MAX_ADDRS];
    char why[320];
    int backoff = 10;
    why[0] = '\0';
    for (;;) {
        int retry = 0, n, i, fatal = 0;
        n = dtr__rdzv_resolve(st->cfg.master_addr, st->port, addrs, DTR__RDZV_MAX_ADDRS, why, sizeof why, &retry);
        if (n == 0 && !retry)
            return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank %ld: master address: %s", (long)st->cfg.rank,
                             why);
        for (i = 0; i < n; i++) {
            int fd;
            char w[320];
            dtr_result r = dtr__rdzv_join(st, &addrs[i], deadline, &fd, w, sizeof w, &fatal);
            if (r == DTR_OK) {
                st->fd = fd;
                return DTR_OK;
            }
            if (fatal)
                return dtr__errf(err, errlen, r, "rendezvous rank %ld: joining the server (rank 0) at %s: %s",
                                 (long)st->cfg.rank, st->where, w);
            if (r != DTR_TIMEOUT || !why[0]) memcpy(why, w, sizeof why);   /* keep the most telling reason */
        }
        if (dtr__rdzv_left_ms(deadline) == 0) break;
        dtr__rdzv_sleep_ms(backoff < dtr__rdzv_left_ms(deadline) ? backoff : dtr__rdzv_left_ms(deadline));
        if (backoff < 500) backoff *= 2;
    }
    return dtr__errf(err, errlen, DTR_TIMEOUT,
                     "rendezvous rank %ld: could not join the server (rank 0) at %s within %d ms: %s "
                     "(is rank 0 running, are DTR_MASTER_ADDR and DTR_MASTER_PORT right?)",
                     (long)st->cfg.rank, st->where, st->cfg.timeout_ms, why[0] ? why : "no answer");
}

static void dtr__rdzv_close_client(dtr_store *st) {
    if (st->fd >= 0) close(st->fd);
    st->fd = -1;
}

dtr_result dtr_store_create(const dtr_rendezvous_config *cfg, dtr_store **out, char *err, size_t errlen) {
    dtr_store *st;
    dtr_result r;
    char msg[768];
    const dtr_allocation_callbacks *a;
    int have;
    if (err && errlen) err[0] = '\0';
    if (out) *out = NULL;
    if (!cfg || !out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "rendezvous: cfg or out is NULL");
    a = &cfg->alloc;
    have = (a->malloc_fn != NULL) + (a->realloc_fn != NULL) + (a->free_fn != NULL);
    if (have != 0 && have != 3)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: set all three allocation callbacks or none");
    if (!memchr(cfg->secret, 0, sizeof cfg->secret) || !memchr(cfg->master_addr, 0, sizeof cfg->master_addr))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: secret or master_addr is not NUL-terminated");
    if (!cfg->secret[0])
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "rendezvous: no secret: set DTR_SECRET (the same on every rank) or cfg.secret");
    if (cfg->world_size < 0 || cfg->rank < 0 || cfg->rank >= (cfg->world_size ? cfg->world_size : 1))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: rank %ld outside [0, world size %ld)",
                         (long)cfg->rank, (long)cfg->world_size);
    if (cfg->port < 0 || cfg->port > 65535 || (cfg->port == 0 && cfg->world_size > 1))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "rendezvous: port %d outside 1..65535 (0 only for a one-process job)", cfg->port);
    if (!memchr(cfg->job_id, 0, sizeof cfg->job_id) || cfg->generation < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: job_id is not NUL-terminated or generation < 0");
    if (cfg->timeout_ms < 0 || cfg->max_keys < 0 || cfg->max_connections < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: negative timeout_ms, max_keys or max_connections");
    st = (dtr_store *)dtr__calloc(a, sizeof *st);
    if (!st) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous: out of memory");
    st->cfg = *cfg;
    if (st->cfg.timeout_ms == 0) st->cfg.timeout_ms = dtr__default_timeout_ms();
    if (st->cfg.grace_ms <= 0) st->cfg.grace_ms = dtr__default_grace_ms();
    if (!st->cfg.master_addr[0]) memcpy(st->cfg.master_addr, "127.0.0.1", 10);
    if (st->cfg.world_size == 0) st->cfg.world_size = 1;
    st->fd = -1;
    st->port = cfg->port;
    if (pthread_mutex_init(&st->lock, NULL) != 0) {
        dtr__free(a, st);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous: cannot make a mutex");
    }
    {
        int64_t deadline = dtr__rdzv_now_ms() + st->cfg.timeout_ms;
        if (st->cfg.rank == 0) {
            r = dtr__rdzv_host_start(&st->cfg, &st->host, &st->port, msg, sizeof msg);
            if (r != DTR_OK) goto fail;
        }
        if (strchr(st->cfg.master_addr, ':') && st->cfg.master_addr[0] != '[')
            snprintf(st->where, sizeof st->where, "[%s]:%d", st->cfg.master_addr, st->port);
        else
            snprintf(st->where, sizeof st->where, "%s:%d", st->cfg.master_addr, st->port);
        r = dtr__rdzv_connect(st, deadline, msg, sizeof msg);
        if (r != DTR_OK) goto fail;
    }
    *out = st;
    return DTR_OK;
fail:
    dtr__rdzv_log(&st->cfg, DTR_LOG_ERROR, "%s", msg);
    dtr__errf(err, errlen, r, "%s", msg);
    if (st->host) dtr__rdzv_host_stop(st->host, 'q', 0);
    pthread_mutex_destroy(&st->lock);
    dtr__free(a, st);
    return r;
}

dtr_result dtr__store_clone(const dtr_store *st, int timeout_ms, dtr_store **out, char *err, size_t errlen) {
    dtr_store *c;
    dtr_result r;
    if (out) *out = NULL;
    if (!st || !out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "rendezvous: store or out is NULL");
    c = (dtr_store *)dtr__calloc(&st->cfg.alloc, sizeof *c);
    if (!c) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous: out of memory");
    c->cfg = st->cfg;
    if (timeout_ms > 0) c->cfg.timeout_ms = timeout_ms;
    c->fd = -1;
    c->port = st->port;
    memcpy(c->where, st->where, sizeof c->where);
    if (pthread_mutex_init(&c->lock, NULL) != 0) {
        dtr__free(&st->cfg.alloc, c);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous: cannot make a mutex");
    }
    r = dtr__rdzv_connect(c, dtr__rdzv_now_ms() + c->cfg.timeout_ms, err, errlen);
    if (r != DTR_OK) {
        pthread_mutex_destroy(&c->lock);
        dtr__free(&st->cfg.alloc, c);
        return r;
    }
    *out = c;
    return DTR_OK;
}

void dtr__store_set_timeout(dtr_store *st, int timeout_ms) {
    if (!st || timeout_ms <= 0) return;
    pthread_mutex_lock(&st->lock);
    st->cfg.timeout_ms = timeout_ms;
    pthread_mutex_unlock(&st->lock);
}

void dtr_store_mark_failed(dtr_store *st) {
    if (st) DTR__ATOMIC_STORE(&st->failed, 1);
}

void dtr__store_cut(dtr_store *st) {
    int64_t none = 0;
    if (!st) return;
    DTR__ATOMIC_STORE(&st->failed, 1);
    DTR__ATOMIC_CAS(&st->cut, &none, dtr__rdzv_now_ms() + st->cfg.grace_ms);   /* the first cut holds */
}

void dtr_store_destroy(dtr_store *st) {
    dtr_allocation_callbacks a;
    int wait_ms;
    if (!st) return;
    dtr__rdzv_close_client(st);
    wait_ms = st->cfg.timeout_ms;
    if (DTR__ATOMIC_LOAD(&st->failed) && st->cfg.grace_ms < wait_ms) wait_ms = st->cfg.grace_ms;
    if (st->host) dtr__rdzv_host_stop(st->host, 'd', dtr__rdzv_now_ms() + wait_ms);
    pthread_mutex_destroy(&st->lock);
    a = st->cfg.alloc;
    dtr__free(&a, st);
}

/* Checks a key given to the API. */
static dtr_result dtr__rdzv_check_key(dtr_store *st, const char *op, const char *key, size_t *klen) {
    size_t n;
    if (!key) return dtr__rdzv_fail(st, DTR_NULL_HANDLE, "rendezvous rank %ld: store %s: key is NULL", (long)st->cfg.rank, op);
    n = strlen(key);
    if (n < 1 || n > DTR_STORE_MAX_KEY)
        return dtr__rdzv_fail(st, DTR_INVALID_ARGUMENT, "rendezvous rank %ld: store %s: key of %lu bytes (1..%d allowed)",
                              (long)st->cfg.rank, op, (unsigned long)n, DTR_STORE_MAX_KEY);
    *klen = n;
    return DTR_OK;
}

static const char *dtr__rdzv_op_name(int op) {
    switch (op) {
    case DTR__RDZV_SET: return "set";
    case DTR__RDZV_GET: return "get";
    case DTR__RDZV_ADD: return "add";
    case DTR__RDZV_CHECK: return "check";
    case DTR__RDZV_DEL: return "delete";
    }
    return "?";
}

/* One request and its reply, before `deadline`. The reply's value goes to buf (up to cap
 * bytes; the rest is read and dropped); *vlen gets its full length. Lock held by the caller. */
static dtr_result dtr__rdzv_call(dtr_store *st, int op, const char *key, size_t klen, const void *value, size_t len,
                                 int64_t deadline, void *buf, size_t cap, size_t *vlen, int *status) {
    uint8_t hdr[DTR__RDZV_HDR + DTR_STORE_MAX_KEY], rh[DTR__RDZV_HDR], sink[4096];
    uint32_t id;
    int e = 0;
    size_t got;
    dtr_result r;
    const char *opn = dtr__rdzv_op_name(op);
    if (st->broken != DTR_OK)
        return dtr__rdzv_fail(st, st->broken, "rendezvous rank %ld: store %s '%.64s': the connection to the server "
                              "(rank 0 at %s) was lost earlier: %s", (long)st->cfg.rank, opn, key, st->where,
                              st->broken_msg);
    id = ++st->next_id;
    memset(hdr, 0, DTR__RDZV_HDR);
    hdr[0] = (uint8_t)op;
    hdr[2] = (uint8_t)(klen >> 8);
    hdr[3] = (uint8_t)klen;
    dtr__rdzv_put32(hdr + 4, (uint32_t)len);
    dtr__rdzv_put32(hdr + 8, id);
    memcpy(hdr + DTR__RDZV_HDR, key, klen);
    r = dtr__rdzv_send_cut(st->fd, hdr, DTR__RDZV_HDR + klen, deadline, &st->cut, &e);
    if (r == DTR_OK && len) r = dtr__rdzv_send_cut(st->fd, value, len, deadline, &st->cut, &e);
    if (r != DTR_OK) {
        /* part of a request may be on the wire: the stream cannot be trusted any more */
        st->broken = r == DTR_TIMEOUT ? DTR_TIMEOUT : DTR_PEER_FAILED;
        snprintf(st->broken_msg, sizeof st->broken_msg, "%s",
                 r == DTR_TIMEOUT ? "the server stopped reading (send timed out)" : dtr__rdzv_errno_str(e));
        dtr__rdzv_close_client(st);
        return dtr__rdzv_fail(st, st->broken, "rendezvous rank %ld: store %s '%.64s': %s the server (rank 0 at %s): %s",
                              (long)st->cfg.rank, opn, key, r == DTR_TIMEOUT ? "timed out sending to" : "lost the connection to",
                              st->where, st->broken_msg);
    }
    for (;;) {
        uint32_t rlen, rid;
        size_t keep, off;
        r = dtr__rdzv_recv_cut(st->fd, rh, sizeof rh, deadline, &st->cut, &got, &e);
        if (r == DTR_TIMEOUT && got == 0) {
            /* nothing of the reply yet: the connection stays usable; a late reply has an old id */
            if (op == DTR__RDZV_GET)
                return dtr__rdzv_fail(st, DTR_TIMEOUT, "rendezvous rank %ld: store get '%.64s': timed out after %d ms: "
                                      "the key was not set (server: rank 0 at %s)", (long)st->cfg.rank, key,
                                      st->cfg.timeout_ms, st->where);
            return dtr__rdzv_fail(st, DTR_TIMEOUT, "rendezvous rank %ld: store %s '%.64s': timed out after %d ms: "
                                  "no reply from the server (rank 0 at %s)", (long)st->cfg.rank, opn, key,
                                  st->cfg.timeout_ms, st->where);
        }
        if (r == DTR_OK) {
            rlen = dtr__rdzv_get32(rh + 4);
            rid = dtr__rdzv_get32(rh + 8);
            if (rh[0] > DTR__RDZV_FULL || rh[1] || rh[2] || rh[3] || rlen > DTR_STORE_MAX_VALUE) {
                r = DTR_PEER_FAILED;
                e = 0;
                snprintf(st->broken_msg, sizeof st->broken_msg, "malformed reply from the server");
            }
        }
        if (r == DTR_OK) {
            keep = rid == id ? (cap < rlen ? cap : rlen) : 0;
            if (keep) r = dtr__rdzv_recv_cut(st->fd, buf, keep, deadline, &st->cut, &got, &e);
            for (off = keep; r == DTR_OK && off < rlen; off += got) {
                size_t chunk = rlen - off < sizeof sink ? rlen - off : sizeof sink;
                r = dtr__rdzv_recv_cut(st->fd, sink, chunk, deadline, &st->cut, &got, &e);
            }
        }
        if (r != DTR_OK) {
            st->broken = r == DTR_TIMEOUT ? DTR_TIMEOUT : DTR_PEER_FAILED;
            if (r == DTR_TIMEOUT) snprintf(st->broken_msg, sizeof st->broken_msg, "a reply stopped half-way");
            else if (!st->broken_msg[0] || e) snprintf(st->broken_msg, sizeof st->broken_msg, "%s", dtr__rdzv_errno_str(e));
            dtr__rdzv_close_client(st);
            return dtr__rdzv_fail(st, st->broken, "rendezvous rank %ld: store %s '%.64s': lost the connection to the "
                                  "server (rank 0 at %s): %s", (long)st->cfg.rank, opn, key, st->where, st->broken_msg);
        }
        if (rid != id) continue;   /* a late reply to a request that timed out */
        if (vlen) *vlen = rlen;
        *status = rh[0];
        return DTR_OK;
    }
}

dtr_result dtr_store_set(dtr_store *st, const char *key, const void *value, size_t len) {
    size_t klen = 0, vlen = 0;
    int status = 0;
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    if ((r = dtr__rdzv_check_key(st, "set", key, &klen)) != DTR_OK) goto done;
    if (len > DTR_STORE_MAX_VALUE || (len && !value)) {
        r = dtr__rdzv_fail(st, DTR_INVALID_ARGUMENT, "rendezvous rank %ld: store set '%.64s': value of %lu bytes%s "
                           "(at most %lu)", (long)st->cfg.rank, key, (unsigned long)len, value ? "" : " is NULL",
                           (unsigned long)DTR_STORE_MAX_VALUE);
        goto done;
    }
    r = dtr__rdzv_call(st, DTR__RDZV_SET, key, klen, value, len, dtr__rdzv_now_ms() + st->cfg.timeout_ms, NULL, 0,
                       &vlen, &status);
    if (r == DTR_OK && status == DTR__RDZV_FULL)
        r = dtr__rdzv_fail(st, DTR_OUT_OF_MEMORY, "rendezvous rank %ld: store set '%.64s': the store is full "
                           "(max_keys / max_bytes on rank 0)", (long)st->cfg.rank, key);
done:
    pthread_mutex_unlock(&st->lock);
    return r;
}

/* get and check. */
static dtr_result dtr__rdzv_get(dtr_store *st, int op, const char *key, void *buf, size_t cap, size_t *len,
                                int *found, int64_t deadline) {
    size_t klen = 0, vlen = 0;
    int status = 0;
    dtr_result r;
    if (found) *found = 0;
    if (len) *len = 0;
    if ((r = dtr__rdzv_check_key(st, dtr__rdzv_op_name(op), key, &klen)) != DTR_OK) return r;
    if (cap && !buf) return dtr__rdzv_fail(st, DTR_NULL_HANDLE, "rendezvous rank %ld: store %s '%.64s': buf is NULL",
                                           (long)st->cfg.rank, dtr__rdzv_op_name(op), key);
    r = dtr__rdzv_call(st, op, key, klen, NULL, 0, deadline, buf, cap, &vlen, &status);
    if (r != DTR_OK) return r;
    if (status == DTR__RDZV_NOT_FOUND) return DTR_OK;
    if (found) *found = 1;
    if (len) *len = vlen;
    if (vlen > cap)
        return dtr__rdzv_fail(st, DTR_INVALID_ARGUMENT, "rendezvous rank %ld: store %s '%.64s': the value has %lu bytes, "
                              "the buffer %lu", (long)st->cfg.rank, dtr__rdzv_op_name(op), key, (unsigned long)vlen,
                              (unsigned long)cap);
    return DTR_OK;
}

dtr_result dtr_store_get(dtr_store *st, const char *key, void *buf, size_t cap, size_t *len) {
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    r = dtr__rdzv_get(st, DTR__RDZV_GET, key, buf, cap, len, NULL, dtr__rdzv_now_ms() + st->cfg.timeout_ms);
    pthread_mutex_unlock(&st->lock);
    return r;
}

dtr_result dtr_store_check(dtr_store *st, const char *key, void *buf, size_t cap, size_t *len, int *found) {
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    r = dtr__rdzv_get(st, DTR__RDZV_CHECK, key, buf, cap, len, found, dtr__rdzv_now_ms() + st->cfg.timeout_ms);
    pthread_mutex_unlock(&st->lock);
    return r;
}

static dtr_result dtr__rdzv_add(dtr_store *st, const char *key, int64_t delta, int64_t *result, int64_t deadline) {
    uint8_t d[8], v[8];
    size_t klen = 0, vlen = 0;
    int status = 0;
    dtr_result r;
    if ((r = dtr__rdzv_check_key(st, "add", key, &klen)) != DTR_OK) return r;
    dtr__rdzv_put64(d, (uint64_t)delta);
    r = dtr__rdzv_call(st, DTR__RDZV_ADD, key, klen, d, 8, deadline, v, sizeof v, &vlen, &status);
    if (r != DTR_OK) return r;
    if (status == DTR__RDZV_NOT_INTEGER)
        return dtr__rdzv_fail(st, DTR_INVALID_ARGUMENT, "rendezvous rank %ld: store add '%.64s': the key holds something "
                              "that is not a decimal int64, or the sum overflows", (long)st->cfg.rank, key);
    if (status == DTR__RDZV_FULL)
        return dtr__rdzv_fail(st, DTR_OUT_OF_MEMORY, "rendezvous rank %ld: store add '%.64s': the store is full",
                              (long)st->cfg.rank, key);
    if (status != DTR__RDZV_OK || vlen != 8)
        return dtr__rdzv_fail(st, DTR_PEER_FAILED, "rendezvous rank %ld: store add '%.64s': malformed reply",
                              (long)st->cfg.rank, key);
    if (result) *result = (int64_t)dtr__rdzv_get64(v);
    return DTR_OK;
}

dtr_result dtr_store_add(dtr_store *st, const char *key, int64_t delta, int64_t *result) {
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    r = dtr__rdzv_add(st, key, delta, result, dtr__rdzv_now_ms() + st->cfg.timeout_ms);
    pthread_mutex_unlock(&st->lock);
    return r;
}

static dtr_result dtr__rdzv_del(dtr_store *st, const char *key, int64_t deadline) {
    size_t klen = 0, vlen = 0;
    int status = 0;
    dtr_result r;
    if ((r = dtr__rdzv_check_key(st, "delete", key, &klen)) != DTR_OK) return r;
    return dtr__rdzv_call(st, DTR__RDZV_DEL, key, klen, NULL, 0, deadline, NULL, 0, &vlen, &status);
}

dtr_result dtr_store_delete(dtr_store *st, const char *key) {
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    r = dtr__rdzv_del(st, key, dtr__rdzv_now_ms() + st->cfg.timeout_ms);
    pthread_mutex_unlock(&st->lock);
    return r;
}

/* Barrier n (1-based) uses the counter "dtr/barrier" (ranks add 1; barrier n is complete when
 * it reaches n * world) and the flag "dtr/barrier/<n>" set by the rank that completes it. That
 * rank first deletes flag n-1: every rank has read it, since all have arrived at barrier n.
 * So barriers hold two keys however many there are. */
dtr_result dtr_store_barrier(dtr_store *st, const char *tag) {
    int64_t deadline, count = 0, gen, world;
    char key[48], prev[48], shown[72];
    size_t vlen = 0;
    dtr_result r;
    if (!st) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&st->lock);
    st->err[0] = '\0';
    world = st->cfg.world_size;
    deadline = dtr__rdzv_now_ms() + st->cfg.timeout_ms;
    shown[0] = '\0';
    if (tag) snprintf(shown, sizeof shown, " ('%.60s')", tag);
    r = dtr__rdzv_add(st, "dtr/barrier", 1, &count, deadline);
    if (r != DTR_OK) goto done;
    gen = (count - 1) / world + 1;
    if (gen != st->barriers + 1) {
        r = dtr__rdzv_fail(st, DTR_BAD_STATE, "rendezvous rank %ld: barrier %lld%s: the ranks are at barrier %lld "
                           "(barriers called in a different order, or a rank restarted?)", (long)st->cfg.rank,
                           (long long)(st->barriers + 1), shown, (long long)gen);
        goto done;
    }
    snprintf(key, sizeof key, "dtr/barrier/%lld", (long long)gen);
    if (count == gen * world) {
        int status = 0;
        r = DTR_OK;
        if (gen > 1) {
            snprintf(prev, sizeof prev, "dtr/barrier/%lld", (long long)(gen - 1));
            r = dtr__rdzv_del(st, prev, deadline);
        }
        if (r == DTR_OK)
            r = dtr__rdzv_call(st, DTR__RDZV_SET, key, strlen(key), "1", 1, deadline, NULL, 0, &vlen, &status);
        if (r != DTR_OK) goto done;
    }
    {
        char flag[4];
        int status = 0;
        r = dtr__rdzv_call(st, DTR__RDZV_GET, key, strlen(key), NULL, 0, deadline, flag, sizeof flag, &vlen, &status);
    }
    if (r == DTR_TIMEOUT && st->broken == DTR_OK) {
        int64_t now_count = count;
        char text[24];
        size_t tl = 0;
        int status = 0;
        if (dtr__rdzv_call(st, DTR__RDZV_CHECK, "dtr/barrier", 11, NULL, 0, dtr__rdzv_now_ms() + 1000, text,
                           sizeof text - 1, &tl, &status) == DTR_OK && status == DTR__RDZV_OK && tl < sizeof text) {
            text[tl] = '\0';
            (void)dtr__rdzv_parse_counter((const uint8_t *)text, tl, &now_count);
        }
        r = dtr__rdzv_fail(st, DTR_TIMEOUT, "rendezvous rank %ld: barrier %lld%s: timed out after %d ms: %lld of %lld "
                           "ranks arrived", (long)st->cfg.rank, (long long)gen, shown, st->cfg.timeout_ms,
                           (long long)(now_count - (gen - 1) * world), (long long)world);
        goto done;
    }
    if (r == DTR_OK) st->barriers = gen;
done:
    if (r != DTR_OK && strncmp(st->err, "rendezvous rank", 15) == 0 && !strstr(st->err, ": barrier ")) {
        char inner[sizeof st->err];
        const char *what = strstr(st->err, ": store ");
        memcpy(inner, st->err, sizeof inner);
        (void)dtr__errf(st->err, sizeof st->err, r, "rendezvous rank %ld: barrier %lld%s: %s", (long)st->cfg.rank,
                        (long long)(st->barriers + 1), shown, what ? what + 2 : inner);
    }
    pthread_mutex_unlock(&st->lock);
    return r;
}

const char *dtr_store_last_error(const dtr_store *st) { return st ? st->err : "rendezvous: store is NULL"; }
int32_t dtr_store_rank(const dtr_store *st) { return st ? st->cfg.rank : -1; }
int32_t dtr_store_world_size(const dtr_store *st) { return st ? st->cfg.world_size : 0; }
int dtr_store_port(const dtr_store *st) { return st ? st->port : 0; }

#endif /* POSIX */

#ifdef __cplusplus
}
#endif
