/* ============================================================================
 * Rendezvous, part 2 of 4: the built-in TCP store's protocol and its server logic on memory
 * buffers (no sockets), so tests/fuzz/fuzz_rdzv.c drives it directly.
 *
 * Rank 0 runs the server on a thread of its own: one poll() loop over the listening
 * sockets, a wake-up pipe and every connection, all non-blocking, so a client that stalls
 * or sends garbage holds nobody up. Every rank, rank 0 included, is a client with one
 * blocking-with-deadline connection.
 *
 * Wire format (all integers big-endian; docs/rendezvous.md has the full description):
 *   server hello    40 B  "DTRZ" u32 version  nonce_s[32]
 *   client auth    100 B  "DTRA" u32 version  u32 rank  u32 world  u32 generation  job[16]
 *                         nonce_c[32]  mac[32]
 *                         mac = HMAC-SHA256(secret, "dtr-rdzv-2 join" || nonce_s || auth[0..68))
 *                         job = the first 16 bytes of SHA-256(job id)
 *   server welcome  44 B  "DTRW" u32 status  u32 generation (the server's)  mac[32]
 *                         mac = HMAC-SHA256(secret, "dtr-rdzv-2 welcome" || nonce_c || nonce_s
 *                               || welcome[0..12)), zero when the status is a refusal
 *   request         12 B  u8 op  u8 0  u16 key_len  u32 value_len  u32 id,  then key, value
 *   reply           12 B  u8 status  u8 0  u16 0  u32 value_len  u32 id,  then value
 * The server reads exactly 100 bytes from a new connection and checks the MAC before it
 * looks at any field. Every length is checked against its bound as soon as its header is
 * complete, before a byte of the body is buffered; a message that breaks a rule closes
 * that connection (the reason is logged) and nothing else.
 *
 * The server logic (dtr__rdzv_server_*, dtr__rdzv_conn_*) works on in-memory buffers and
 * knows nothing of sockets, so tests/fuzz/fuzz_rdzv.c drives it directly.
 *
 * Portability: POSIX sockets, poll, pthreads. Only interfaces that glibc and musl declare
 * under plain -std=c99 are required (the amalgamation cannot define feature-test macros
 * after the user's headers): getaddrinfo is used when the headers declare it (AI_PASSIVE),
 * else numeric addresses go through inet_pton and host names through gethostbyname (IPv4).
 * Time is dtr_time_ns (src/comm/comm.c), which finds the monotonic clock under -std=c99 too.
 * Windows: the store reports DTR_UNSUPPORTED.
 * Uses dtr__hmac_* and dtr__ct_equal from src/rendezvous/sha256.c (just before it in the
 * amalgamation).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_rdzv.h"
#include "../public/api_comm.h"
#include "../core/internal.h"

#include <limits.h>

#if !defined(_WIN32)
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

#ifdef __cplusplus
extern "C" {
#endif

/* ---- protocol constants ---- */

#define DTR__RDZV_VERSION 2u
#define DTR__RDZV_NONCE 32
#define DTR__RDZV_MAC 32
#define DTR__RDZV_JOB 16            /* bytes of the job tag (a truncated SHA-256 of the job id) */
#define DTR__RDZV_HELLO_LEN 40
#define DTR__RDZV_AUTH_LEN 100
#define DTR__RDZV_AUTH_NONCE 36     /* offset of the client nonce in the auth message */
#define DTR__RDZV_AUTH_SIGNED 68    /* bytes of the auth message covered by its MAC */
#define DTR__RDZV_WELCOME_LEN 44
#define DTR__RDZV_WELCOME_SIGNED 12 /* bytes of the welcome covered by its MAC */
#define DTR__RDZV_HDR 12
#define DTR__RDZV_MAX_FRAME (DTR__RDZV_HDR + DTR_STORE_MAX_KEY + DTR_STORE_MAX_VALUE)

/* request ops */
enum { DTR__RDZV_SET = 1, DTR__RDZV_GET = 2, DTR__RDZV_ADD = 3, DTR__RDZV_CHECK = 4, DTR__RDZV_DEL = 5 };
/* reply status */
enum { DTR__RDZV_OK = 0, DTR__RDZV_NOT_FOUND = 1, DTR__RDZV_NOT_INTEGER = 2, DTR__RDZV_FULL = 3 };
/* welcome status */
enum {
    DTR__RDZV_W_OK = 0, DTR__RDZV_W_BAD_SECRET = 1, DTR__RDZV_W_BAD_RANK = 2, DTR__RDZV_W_BAD_VERSION = 3,
    DTR__RDZV_W_STALE = 4, DTR__RDZV_W_OLD_SERVER = 5, DTR__RDZV_W_OTHER_JOB = 6
};
/* (W_BAD_RANK: the rank is not below the world size, or the world sizes differ; W_STALE: the
 * rank is of an older generation than the store, a rank of a world that was restarted;
 * W_OLD_SERVER: the store is of an older generation than the rank, a server that is going
 * away: the rank retries; W_OTHER_JOB: the store belongs to another job (job ids differ)) */
/* connection states */
enum { DTR__RDZV_C_AUTH = 0, DTR__RDZV_C_READY = 1, DTR__RDZV_C_CLOSING = 2 };

static const char dtr__rdzv_join_label[] = "dtr-rdzv-2 join";
static const char dtr__rdzv_welcome_label[] = "dtr-rdzv-2 welcome";

#ifdef MSG_NOSIGNAL
#define DTR__RDZV_NOSIGNAL MSG_NOSIGNAL
#else
#define DTR__RDZV_NOSIGNAL 0
#endif

/* ---- small helpers ---- */

static void dtr__rdzv_put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
static uint32_t dtr__rdzv_get32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}
static void dtr__rdzv_put64(uint8_t *p, uint64_t v) {
    dtr__rdzv_put32(p, (uint32_t)(v >> 32));
    dtr__rdzv_put32(p + 4, (uint32_t)v);
}
static uint64_t dtr__rdzv_get64(const uint8_t *p) {
    return ((uint64_t)dtr__rdzv_get32(p) << 32) | dtr__rdzv_get32(p + 4);
}

/* Monotonic milliseconds (the library's one clock, dtr_time_ns). */
static int64_t dtr__rdzv_now_ms(void) { return dtr_time_ns() / 1000000; }

/* Milliseconds left until `deadline`, clamped to [0, INT_MAX]. */
static int dtr__rdzv_left_ms(int64_t deadline) {
    int64_t left = deadline - dtr__rdzv_now_ms();
    if (left < 0) return 0;
    if (left > INT_MAX) return INT_MAX;
    return (int)left;
}

static void dtr__rdzv_sleep_ms(int ms) {
    if (ms > 0) (void)poll(NULL, 0, ms);
}

/* Cryptographic random bytes from /dev/urandom; should that fail, SHA-256 of the time, the
 * process id, a counter and an address (unique, if not unpredictable: enough for nonces,
 * whose job is never to repeat). */
static void dtr__rdzv_random(uint8_t *out, size_t n) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static uint64_t counter;
    size_t got = 0;
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd >= 0) {
        while (got < n) {
            ssize_t k = read(fd, out + got, n - got);
            if (k > 0) got += (size_t)k;
            else if (k < 0 && errno == EINTR) continue;
            else break;
        }
        close(fd);
    }
    while (got < n) {
        uint8_t seed[40], h[32];
        int64_t t = dtr__rdzv_now_ms();
        long pid = (long)getpid();
        uint64_t c;
        const void *addr = &seed;
        size_t take;
        pthread_mutex_lock(&lock);
        c = ++counter;
        pthread_mutex_unlock(&lock);
        memset(seed, 0, sizeof seed);
        memcpy(seed, &t, sizeof t);
        memcpy(seed + 8, &pid, sizeof pid < 8 ? sizeof pid : 8);
        memcpy(seed + 16, &c, sizeof c);
        memcpy(seed + 24, &addr, sizeof addr < 16 ? sizeof addr : 16);
        dtr__sha256_once(seed, sizeof seed, h);
        take = n - got < 32 ? n - got : 32;
        memcpy(out + got, h, take);
        got += take;
    }
}

/* Log through the configuration's callback. */
static void dtr__rdzv_log(const dtr_rendezvous_config *cfg, dtr_log_level level, const char *fmt, ...) DTR__PRINTF(3, 4);
static void dtr__rdzv_log(const dtr_rendezvous_config *cfg, dtr_log_level level, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    if (!cfg->log || level > cfg->log_level) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    cfg->log(cfg->log_user, level, msg);
}

/* Key as text for messages: printable ASCII kept, anything else as '?'; at most 64 chars. */
static const char *dtr__rdzv_show_key(const uint8_t *key, size_t n, char *buf, size_t cap) {
    size_t i, m = n < 64 ? n : 64;
    if (m + 4 > cap) m = cap > 4 ? cap - 4 : 0;
    for (i = 0; i < m; i++) buf[i] = (key[i] >= 0x20 && key[i] < 0x7f) ? (char)key[i] : '?';
    if (m < n && i + 3 < cap) { buf[i++] = '.'; buf[i++] = '.'; buf[i++] = '.'; }
    buf[i] = '\0';
    return buf;
}

/* ======================================================================
 * The server logic, on memory buffers (no sockets).
 * ====================================================================*/

typedef struct dtr__rdzv_entry {
    struct dtr__rdzv_entry *next;
    uint32_t hash, klen, vlen;
    uint8_t *val;        /* vlen bytes (NULL when 0) */
    /* key bytes follow the struct */
} dtr__rdzv_entry;

typedef struct dtr__rdzv_conn {
    int fd;                          /* -1 when driven from memory */
    int state;                       /* DTR__RDZV_C_* */
    int32_t rank;                    /* -1 until authenticated */
    int64_t deadline_ms;             /* handshake deadline (socket layer) */
    char peer[64];                   /* "127.0.0.1:5555", for messages */
    uint8_t nonce[DTR__RDZV_NONCE];  /* the server's challenge */
    uint8_t *in;                     /* the message being received */
    size_t in_len, in_cap, frame_len;  /* frame_len: full length once the header is in, else 0 */
    uint8_t *out;                    /* replies not yet sent: out[out_pos .. out_len) */
    size_t out_pos, out_len, out_cap;
    int waiting;                     /* a GET is parked until its key is set */
    uint32_t wait_id;
    uint32_t wait_klen;
    uint8_t wait_key[DTR_STORE_MAX_KEY];
} dtr__rdzv_conn;

typedef struct dtr__rdzv_server {
    dtr_rendezvous_config cfg;       /* limits resolved (no zeros) */
    dtr__rdzv_entry **buckets;
    size_t nbuckets, nkeys, nbytes;
    dtr__rdzv_conn **conns;
    int nconns, cap_conns;
    uint64_t refused;                /* connections refused or closed for a protocol error */
} dtr__rdzv_server;

/* A parsed request header. */
typedef struct dtr__rdzv_req {
    int op;
    uint32_t klen, vlen, id;
} dtr__rdzv_req;

/* The server core, used by server.c (and driven directly by tests/fuzz/fuzz_rdzv.c, which
 * compiles the implementation itself). */
DTR__PRIVATE dtr_result dtr__rdzv_server_init(dtr__rdzv_server *s, const dtr_rendezvous_config *cfg);
DTR__PRIVATE void dtr__rdzv_server_free(dtr__rdzv_server *s);
DTR__PRIVATE int dtr__rdzv_parse_header(const uint8_t *p, dtr__rdzv_req *req, char *why, size_t whylen);
DTR__PRIVATE dtr__rdzv_conn *dtr__rdzv_conn_open(dtr__rdzv_server *s, int fd, const char *peer);
DTR__PRIVATE void dtr__rdzv_conn_feed(dtr__rdzv_server *s, dtr__rdzv_conn *c, const uint8_t *p, size_t n);
DTR__PRIVATE size_t dtr__rdzv_conn_want(const dtr__rdzv_conn *c);
DTR__PRIVATE void dtr__rdzv_conn_close(dtr__rdzv_server *s, dtr__rdzv_conn *c);

static void *dtr__rdzv_alloc(const dtr_rendezvous_config *cfg, size_t n) { return dtr__malloc(&cfg->alloc, n); }
static void dtr__rdzv_free(const dtr_rendezvous_config *cfg, void *p) { dtr__free(&cfg->alloc, p); }

dtr_result dtr__rdzv_server_init(dtr__rdzv_server *s, const dtr_rendezvous_config *cfg) {
    memset(s, 0, sizeof *s);
    s->cfg = *cfg;
    if (s->cfg.max_keys <= 0) s->cfg.max_keys = 65536;
    if (s->cfg.max_connections <= 0) {
        s->cfg.max_connections = 1024;
        if (s->cfg.world_size < INT_MAX - 16 && s->cfg.max_connections < s->cfg.world_size + 16)
            s->cfg.max_connections = s->cfg.world_size + 16;
    }
    if (s->cfg.max_bytes == 0) s->cfg.max_bytes = (size_t)256 << 20;
    s->nbuckets = 64;
    s->buckets = (dtr__rdzv_entry **)dtr__calloc(&s->cfg.alloc, s->nbuckets * sizeof *s->buckets);
    if (!s->buckets) return DTR_OUT_OF_MEMORY;
    return DTR_OK;
}

void dtr__rdzv_server_free(dtr__rdzv_server *s) {
    size_t i;
    while (s->nconns > 0) dtr__rdzv_conn_close(s, s->conns[s->nconns - 1]);
    dtr__rdzv_free(&s->cfg, s->conns);
    if (s->buckets) {
        for (i = 0; i < s->nbuckets; i++) {
            dtr__rdzv_entry *e = s->buckets[i];
            while (e) {
                dtr__rdzv_entry *next = e->next;
                dtr__rdzv_free(&s->cfg, e->val);
                dtr__rdzv_free(&s->cfg, e);
                e = next;
            }
        }
    }
    dtr__rdzv_free(&s->cfg, s->buckets);
    memset(s, 0, sizeof *s);
}

/* ---- the table: a chained hash map of byte-string keys ---- */

static uint32_t dtr__rdzv_hash(const uint8_t *k, size_t n) {
    uint32_t h = 2166136261u;   /* FNV-1a */
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ k[i]) * 16777619u;
    return h;
}

static const uint8_t *dtr__rdzv_entry_key(const dtr__rdzv_entry *e) { return (const uint8_t *)(e + 1); }

static dtr__rdzv_entry **dtr__rdzv_find(dtr__rdzv_server *s, const uint8_t *k, uint32_t klen, uint32_t h) {
    dtr__rdzv_entry **pe = &s->buckets[h & (s->nbuckets - 1)];
    while (*pe) {
        if ((*pe)->hash == h && (*pe)->klen == klen && memcmp(dtr__rdzv_entry_key(*pe), k, klen) == 0) return pe;
        pe = &(*pe)->next;
    }
    return pe;
}

/* Doubles the bucket array (when it can; a failed grow only makes chains longer). */
static void dtr__rdzv_grow(dtr__rdzv_server *s) {
    size_t n = s->nbuckets * 2, i;
    dtr__rdzv_entry **b = (dtr__rdzv_entry **)dtr__calloc(&s->cfg.alloc, n * sizeof *b);
    if (!b) return;
    for (i = 0; i < s->nbuckets; i++) {
        dtr__rdzv_entry *e = s->buckets[i];
        while (e) {
            dtr__rdzv_entry *next = e->next;
            e->next = b[e->hash & (n - 1)];
            b[e->hash & (n - 1)] = e;
            e = next;
        }
    }
    dtr__rdzv_free(&s->cfg, s->buckets);
    s->buckets = b;
    s->nbuckets = n;
}

/* Sets key to value. Returns the entry, or NULL when a limit or the memory runs out
 * (*full says which: 1 limit, 0 memory). */
static dtr__rdzv_entry *dtr__rdzv_table_set(dtr__rdzv_server *s, const uint8_t *k, uint32_t klen, const uint8_t *v,
                                            uint32_t vlen, int *full) {
    uint32_t h = dtr__rdzv_hash(k, klen);
    dtr__rdzv_entry **pe = dtr__rdzv_find(s, k, klen, h), *e = *pe;
    uint8_t *copy = NULL;
    size_t old = e ? e->vlen : 0;
    *full = 1;
    if (!e && s->nkeys >= (size_t)s->cfg.max_keys) return NULL;
    if (s->nbytes - old + vlen + (e ? 0 : klen) > s->cfg.max_bytes) return NULL;
    *full = 0;
    if (vlen) {
        copy = (uint8_t *)dtr__rdzv_alloc(&s->cfg, vlen);
        if (!copy) return NULL;
        memcpy(copy, v, vlen);
    }
    if (!e) {
        e = (dtr__rdzv_entry *)dtr__rdzv_alloc(&s->cfg, sizeof *e + klen);
        if (!e) {
            dtr__rdzv_free(&s->cfg, copy);
            return NULL;
        }
        memset(e, 0, sizeof *e);
        e->hash = h;
        e->klen = klen;
        memcpy((uint8_t *)(e + 1), k, klen);
        *pe = e;
        s->nkeys++;
        s->nbytes += klen;
    }
    dtr__rdzv_free(&s->cfg, e->val);
    e->val = copy;
    e->vlen = vlen;
    s->nbytes = s->nbytes - old + vlen;
    if (s->nkeys > s->nbuckets) dtr__rdzv_grow(s);
    return e;
}

static void dtr__rdzv_table_del(dtr__rdzv_server *s, const uint8_t *k, uint32_t klen) {
    dtr__rdzv_entry **pe = dtr__rdzv_find(s, k, klen, dtr__rdzv_hash(k, klen)), *e = *pe;
    if (!e) return;
    *pe = e->next;
    s->nkeys--;
    s->nbytes -= (size_t)e->klen + e->vlen;
    dtr__rdzv_free(&s->cfg, e->val);
    dtr__rdzv_free(&s->cfg, e);
}

/* Parses a counter: optional '-', 1..19 digits, nothing else; within int64. */
static int dtr__rdzv_parse_counter(const uint8_t *p, size_t n, int64_t *out) {
    uint64_t v = 0, lim;
    size_t i = 0;
    int neg = 0;
    if (n > 0 && p[0] == '-') { neg = 1; i = 1; }
    if (i == n || n - i > 19) return 0;
    lim = neg ? (uint64_t)INT64_MAX + 1u : (uint64_t)INT64_MAX;
    for (; i < n; i++) {
        unsigned d = (unsigned)p[i] - '0';
        if (d > 9) return 0;
        if (v > (lim - d) / 10) return 0;
        v = v * 10 + d;
    }
    if (neg) *out = v == (uint64_t)INT64_MAX + 1u ? INT64_MIN : -(int64_t)v;
    else *out = (int64_t)v;
    return 1;
}

/* ---- connections ---- */

/* Makes room for `more` bytes in c->out. 0 when out of memory. */
static int dtr__rdzv_out_reserve(dtr__rdzv_server *s, dtr__rdzv_conn *c, size_t more) {
    size_t need, cap;
    uint8_t *p;
    if (c->out_pos == c->out_len) c->out_pos = c->out_len = 0;
    need = c->out_len + more;
    if (need <= c->out_cap) return 1;
    cap = c->out_cap ? c->out_cap : 256;
    while (cap < need) cap *= 2;
    p = (uint8_t *)dtr__realloc(&s->cfg.alloc, c->out, cap);
    if (!p) return 0;
    c->out = p;
    c->out_cap = cap;
    return 1;
}

/* Ends a connection after what is queued has been sent; logs why at `level`. */
static void dtr__rdzv_refuse(dtr__rdzv_server *s, dtr__rdzv_conn *c, dtr_log_level level, const char *fmt, ...) DTR__PRINTF(4, 5);
static void dtr__rdzv_refuse(dtr__rdzv_server *s, dtr__rdzv_conn *c, dtr_log_level level, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    c->state = DTR__RDZV_C_CLOSING;
    c->waiting = 0;
    s->refused++;
    if (!s->cfg.log || level > s->cfg.log_level) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->rank >= 0) dtr__rdzv_log(&s->cfg, level, "rendezvous server: closed the connection of rank %ld (%s): %s",
                                    (long)c->rank, c->peer, msg);
    else dtr__rdzv_log(&s->cfg, level, "rendezvous server: refused %s: %s", c->peer, msg);
}

static void dtr__rdzv_reply(dtr__rdzv_server *s, dtr__rdzv_conn *c, int status, uint32_t id, const uint8_t *v,
                            uint32_t vlen) {
    uint8_t *p;
    if (!dtr__rdzv_out_reserve(s, c, DTR__RDZV_HDR + (size_t)vlen)) {
        dtr__rdzv_refuse(s, c, DTR_LOG_ERROR, "out of memory for a reply of %lu bytes", (unsigned long)vlen);
        return;
    }
    p = c->out + c->out_len;
    memset(p, 0, DTR__RDZV_HDR);
    p[0] = (uint8_t)status;
    dtr__rdzv_put32(p + 4, vlen);
    dtr__rdzv_put32(p + 8, id);
    if (vlen) memcpy(p + DTR__RDZV_HDR, v, vlen);
    c->out_len += DTR__RDZV_HDR + (size_t)vlen;
}

dtr__rdzv_conn *dtr__rdzv_conn_open(dtr__rdzv_server *s, int fd, const char *peer) {
    dtr__rdzv_conn *c;
    if (s->nconns >= s->cfg.max_connections) return NULL;
    if (s->nconns == s->cap_conns) {
        int cap = s->cap_conns ? s->cap_conns * 2 : 16;
        dtr__rdzv_conn **a = (dtr__rdzv_conn **)dtr__realloc(&s->cfg.alloc, s->conns, (size_t)cap * sizeof *a);
        if (!a) return NULL;
        s->conns = a;
        s->cap_conns = cap;
    }
    c = (dtr__rdzv_conn *)dtr__calloc(&s->cfg.alloc, sizeof *c);
    if (!c) return NULL;
    c->fd = fd;
    c->rank = -1;
    c->state = DTR__RDZV_C_AUTH;
    snprintf(c->peer, sizeof c->peer, "%s", peer ? peer : "?");
    dtr__rdzv_random(c->nonce, sizeof c->nonce);
    if (!dtr__rdzv_out_reserve(s, c, DTR__RDZV_HELLO_LEN)) {
        dtr__rdzv_free(&s->cfg, c);
        return NULL;
    }
    memcpy(c->out, "DTRZ", 4);
    dtr__rdzv_put32(c->out + 4, DTR__RDZV_VERSION);
    memcpy(c->out + 8, c->nonce, DTR__RDZV_NONCE);
    c->out_len = DTR__RDZV_HELLO_LEN;
    s->conns[s->nconns++] = c;
    return c;
}

void dtr__rdzv_conn_close(dtr__rdzv_server *s, dtr__rdzv_conn *c) {
    int i;
    for (i = 0; i < s->nconns; i++) {
        if (s->conns[i] == c) {
            s->conns[i] = s->conns[--s->nconns];
            break;
        }
    }
    if (c->fd >= 0) close(c->fd);
    dtr__rdzv_free(&s->cfg, c->in);
    dtr__rdzv_free(&s->cfg, c->out);
    dtr__rdzv_free(&s->cfg, c);
}

/* The job tag: the first 16 bytes of SHA-256(job id) ("" for no job id). */
static void dtr__rdzv_job_tag(const char *job, uint8_t *tag) {
    uint8_t h[DTR__SHA256_BYTES];
    dtr__sha256_once(job, strlen(job), h);
    memcpy(tag, h, DTR__RDZV_JOB);
}

/* The MAC of an auth message: HMAC(secret, join label || server nonce || auth[0..68)). */
static void dtr__rdzv_auth_mac(const char *secret, const uint8_t *snonce, const uint8_t *auth, uint8_t *mac) {
    dtr__hmac h;
    dtr__hmac_init(&h, secret, strlen(secret));
    dtr__hmac_update(&h, dtr__rdzv_join_label, sizeof dtr__rdzv_join_label - 1);
    dtr__hmac_update(&h, snonce, DTR__RDZV_NONCE);
    dtr__hmac_update(&h, auth, DTR__RDZV_AUTH_SIGNED);
    dtr__hmac_final(&h, mac);
}

/* The MAC of a welcome: HMAC(secret, welcome label || client nonce || server nonce || welcome[0..12)). */
static void dtr__rdzv_welcome_mac(const char *secret, const uint8_t *cnonce, const uint8_t *snonce,
                                  const uint8_t *welcome, uint8_t *mac) {
    dtr__hmac h;
    dtr__hmac_init(&h, secret, strlen(secret));
    dtr__hmac_update(&h, dtr__rdzv_welcome_label, sizeof dtr__rdzv_welcome_label - 1);
    dtr__hmac_update(&h, cnonce, DTR__RDZV_NONCE);
    dtr__hmac_update(&h, snonce, DTR__RDZV_NONCE);
    dtr__hmac_update(&h, welcome, DTR__RDZV_WELCOME_SIGNED);
    dtr__hmac_final(&h, mac);
}

static void dtr__rdzv_welcome(dtr__rdzv_server *s, dtr__rdzv_conn *c, uint32_t status, const uint8_t *cnonce) {
    uint8_t *p;
    if (!dtr__rdzv_out_reserve(s, c, DTR__RDZV_WELCOME_LEN)) {
        dtr__rdzv_refuse(s, c, DTR_LOG_ERROR, "out of memory");
        return;
    }
    p = c->out + c->out_len;
    memcpy(p, "DTRW", 4);
    dtr__rdzv_put32(p + 4, status);
    dtr__rdzv_put32(p + 8, (uint32_t)s->cfg.generation);
    if (status == DTR__RDZV_W_OK) dtr__rdzv_welcome_mac(s->cfg.secret, cnonce, c->nonce, p, p + 12);
    else memset(p + 12, 0, DTR__RDZV_MAC);
    c->out_len += DTR__RDZV_WELCOME_LEN;
}

/* The job and the generation of an authenticated join message are this store's; else the
 * refusal is sent and 0 returned. */
static int dtr__rdzv_same_job(dtr__rdzv_server *s, dtr__rdzv_conn *c, const uint8_t *m) {
    uint8_t tag[DTR__RDZV_JOB];
    uint32_t gen = dtr__rdzv_get32(m + 16), mine = (uint32_t)s->cfg.generation;
    dtr__rdzv_job_tag(s->cfg.job_id, tag);
    if (memcmp(tag, m + 20, DTR__RDZV_JOB) != 0) {
        dtr__rdzv_welcome(s, c, DTR__RDZV_W_OTHER_JOB, NULL);
        dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "rank %lu belongs to another job (its job id differs from '%.64s')",
                         (unsigned long)dtr__rdzv_get32(m + 8), s->cfg.job_id);
        return 0;
    }
    if (gen != mine) {
        dtr__rdzv_welcome(s, c, gen < mine ? DTR__RDZV_W_STALE : DTR__RDZV_W_OLD_SERVER, NULL);
        dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "rank %lu is of generation %lu; this store is generation %lu",
                         (unsigned long)dtr__rdzv_get32(m + 8), (unsigned long)gen, (unsigned long)mine);
        return 0;
    }
    return 1;
}

/* The 100-byte auth message: the MAC first, then the fields it covers. */
static void dtr__rdzv_handle_auth(dtr__rdzv_server *s, dtr__rdzv_conn *c, const uint8_t *m) {
    uint8_t mac[DTR__RDZV_MAC];
    uint32_t version, rank, world;
    dtr__rdzv_auth_mac(s->cfg.secret, c->nonce, m, mac);
    if (!dtr__ct_equal(mac, m + DTR__RDZV_AUTH_SIGNED, DTR__RDZV_MAC)) {
        dtr__rdzv_welcome(s, c, DTR__RDZV_W_BAD_SECRET, NULL);
        dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "wrong secret (the HMAC of the join message does not match; "
                                             "is DTR_SECRET the same on every rank?)");
        return;
    }
    version = dtr__rdzv_get32(m + 4);
    rank = dtr__rdzv_get32(m + 8);
    world = dtr__rdzv_get32(m + 12);
    if (memcmp(m, "DTRA", 4) != 0 || version != DTR__RDZV_VERSION) {
        dtr__rdzv_welcome(s, c, DTR__RDZV_W_BAD_VERSION, NULL);
        dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "protocol version %lu; this server speaks version %u",
                         (unsigned long)version, DTR__RDZV_VERSION);
        return;
    }
    if (!dtr__rdzv_same_job(s, c, m)) return;
    if (world != (uint32_t)s->cfg.world_size || rank >= world) {
        dtr__rdzv_welcome(s, c, DTR__RDZV_W_BAD_RANK, NULL);
        if (world != (uint32_t)s->cfg.world_size)
            dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "rank %lu joins a world of %lu ranks; this job has %ld",
                             (unsigned long)rank, (unsigned long)world, (long)s->cfg.world_size);
        else
            dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "rank %lu is not below the world size %ld", (unsigned long)rank,
                             (long)s->cfg.world_size);
        return;
    }
    c->rank = (int32_t)rank;
    c->state = DTR__RDZV_C_READY;
    dtr__rdzv_welcome(s, c, DTR__RDZV_W_OK, m + DTR__RDZV_AUTH_NONCE);
    dtr__rdzv_log(&s->cfg, DTR_LOG_DEBUG, "rendezvous server: rank %ld joined from %s", (long)c->rank, c->peer);
}

int dtr__rdzv_parse_header(const uint8_t *p, dtr__rdzv_req *req, char *why, size_t whylen) {
    req->op = p[0];
    req->klen = ((uint32_t)p[2] << 8) | p[3];
    req->vlen = dtr__rdzv_get32(p + 4);
    req->id = dtr__rdzv_get32(p + 8);
    if (req->op < DTR__RDZV_SET || req->op > DTR__RDZV_DEL) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "unknown op %d", req->op);
        return 0;
    }
    if (p[1] != 0) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "reserved byte is %d, not 0", p[1]);
        return 0;
    }
    if (req->klen < 1 || req->klen > DTR_STORE_MAX_KEY) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "key length %lu outside 1..%d", (unsigned long)req->klen,
                  DTR_STORE_MAX_KEY);
        return 0;
    }
    if (req->vlen > DTR_STORE_MAX_VALUE) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "value length %lu over the limit of %lu",
                  (unsigned long)req->vlen, (unsigned long)DTR_STORE_MAX_VALUE);
        return 0;
    }
    if (req->op == DTR__RDZV_ADD && req->vlen != 8) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "add carries %lu bytes, not 8", (unsigned long)req->vlen);
        return 0;
    }
    if ((req->op == DTR__RDZV_GET || req->op == DTR__RDZV_CHECK || req->op == DTR__RDZV_DEL) && req->vlen != 0) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "op %d carries a value of %lu bytes", req->op,
                  (unsigned long)req->vlen);
        return 0;
    }
    return 1;
}

/* Answers every connection parked on key e. */
static void dtr__rdzv_wake(dtr__rdzv_server *s, const dtr__rdzv_entry *e) {
    int i;
    for (i = 0; i < s->nconns; i++) {
        dtr__rdzv_conn *w = s->conns[i];
        if (w->waiting && w->state == DTR__RDZV_C_READY && w->wait_klen == e->klen &&
            memcmp(w->wait_key, dtr__rdzv_entry_key(e), e->klen) == 0) {
            w->waiting = 0;
            dtr__rdzv_reply(s, w, DTR__RDZV_OK, w->wait_id, e->val, e->vlen);
        }
    }
}

/* One complete request: header + key + value in m. */
static void dtr__rdzv_handle_request(dtr__rdzv_server *s, dtr__rdzv_conn *c, const dtr__rdzv_req *q, const uint8_t *m) {
    const uint8_t *key = m + DTR__RDZV_HDR, *val = key + q->klen;
    dtr__rdzv_entry *e;
    char shown[80];
    int full = 0;
    if (memchr(key, 0, q->klen)) {
        dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "malformed request: key contains a NUL byte");
        return;
    }
    c->waiting = 0;   /* a new request means the client gave up on a parked GET */
    switch (q->op) {
    case DTR__RDZV_SET:
        e = dtr__rdzv_table_set(s, key, q->klen, val, q->vlen, &full);
        if (!e) {
            dtr__rdzv_log(&s->cfg, DTR_LOG_WARN, "rendezvous server: set '%s' by rank %ld refused: %s",
                          dtr__rdzv_show_key(key, q->klen, shown, sizeof shown), (long)c->rank,
                          full ? "store full (max_keys or max_bytes)" : "out of memory");
            dtr__rdzv_reply(s, c, DTR__RDZV_FULL, q->id, NULL, 0);
            return;
        }
        dtr__rdzv_reply(s, c, DTR__RDZV_OK, q->id, NULL, 0);
        dtr__rdzv_wake(s, e);
        return;
    case DTR__RDZV_GET:
    case DTR__RDZV_CHECK:
        e = *dtr__rdzv_find(s, key, q->klen, dtr__rdzv_hash(key, q->klen));
        if (e) dtr__rdzv_reply(s, c, DTR__RDZV_OK, q->id, e->val, e->vlen);
        else if (q->op == DTR__RDZV_CHECK) dtr__rdzv_reply(s, c, DTR__RDZV_NOT_FOUND, q->id, NULL, 0);
        else {
            c->waiting = 1;
            c->wait_id = q->id;
            c->wait_klen = q->klen;
            memcpy(c->wait_key, key, q->klen);
        }
        return;
    case DTR__RDZV_ADD: {
        int64_t cur = 0, delta = (int64_t)dtr__rdzv_get64(val), sum;
        char text[24];
        uint8_t out[8];
        e = *dtr__rdzv_find(s, key, q->klen, dtr__rdzv_hash(key, q->klen));
        if (e && !dtr__rdzv_parse_counter(e->val, e->vlen, &cur)) {
            dtr__rdzv_reply(s, c, DTR__RDZV_NOT_INTEGER, q->id, NULL, 0);
            return;
        }
        if ((delta > 0 && cur > INT64_MAX - delta) || (delta < 0 && cur < INT64_MIN - delta)) {
            dtr__rdzv_reply(s, c, DTR__RDZV_NOT_INTEGER, q->id, NULL, 0);
            return;
        }
        sum = cur + delta;
        snprintf(text, sizeof text, "%lld", (long long)sum);
        e = dtr__rdzv_table_set(s, key, q->klen, (const uint8_t *)text, (uint32_t)strlen(text), &full);
        if (!e) {
            dtr__rdzv_reply(s, c, DTR__RDZV_FULL, q->id, NULL, 0);
            return;
        }
        dtr__rdzv_put64(out, (uint64_t)sum);
        dtr__rdzv_reply(s, c, DTR__RDZV_OK, q->id, out, 8);
        dtr__rdzv_wake(s, e);
        return;
    }
    case DTR__RDZV_DEL:
        dtr__rdzv_table_del(s, key, q->klen);
        dtr__rdzv_reply(s, c, DTR__RDZV_OK, q->id, NULL, 0);
        return;
    }
}

size_t dtr__rdzv_conn_want(const dtr__rdzv_conn *c) {
    if (c->state == DTR__RDZV_C_CLOSING) return 0;
    if (c->state == DTR__RDZV_C_AUTH) return DTR__RDZV_AUTH_LEN - c->in_len;
    if (c->frame_len) return c->frame_len - c->in_len;
    return DTR__RDZV_HDR - c->in_len;
}

/* Takes n bytes received from the connection. Complete messages are handled as they come;
 * replies go to c->out. A connection that breaks a rule turns DTR__RDZV_C_CLOSING (reason
 * logged) and takes no more input. The buffer never holds more than one message. */
void dtr__rdzv_conn_feed(dtr__rdzv_server *s, dtr__rdzv_conn *c, const uint8_t *p, size_t n) {
    for (;;) {
        size_t need, take;
        if (c->state == DTR__RDZV_C_CLOSING) return;
        if (c->state == DTR__RDZV_C_AUTH) need = DTR__RDZV_AUTH_LEN;
        else need = c->frame_len ? c->frame_len : DTR__RDZV_HDR;
        if (c->in_len == need) {
            if (c->state == DTR__RDZV_C_AUTH) {
                dtr__rdzv_handle_auth(s, c, c->in);
                c->in_len = 0;
            } else if (!c->frame_len) {
                dtr__rdzv_req q;
                char why[160];
                if (!dtr__rdzv_parse_header(c->in, &q, why, sizeof why)) {
                    dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "malformed request: %s", why);
                    return;
                }
                c->frame_len = DTR__RDZV_HDR + (size_t)q.klen + q.vlen;
            } else {
                dtr__rdzv_req q;
                char why[160];
                (void)dtr__rdzv_parse_header(c->in, &q, why, sizeof why);
                dtr__rdzv_handle_request(s, c, &q, c->in);
                c->in_len = 0;
                c->frame_len = 0;
                if (c->in_cap > 65536) {   /* do not keep a large buffer for an idle connection */
                    dtr__rdzv_free(&s->cfg, c->in);
                    c->in = NULL;
                    c->in_cap = 0;
                }
            }
            continue;
        }
        if (n == 0) return;
        if (c->in_cap < need) {
            uint8_t *b = (uint8_t *)dtr__realloc(&s->cfg.alloc, c->in, need);
            if (!b) {
                dtr__rdzv_refuse(s, c, DTR_LOG_ERROR, "out of memory for a message of %lu bytes", (unsigned long)need);
                return;
            }
            c->in = b;
            c->in_cap = need;
        }
        take = need - c->in_len;
        if (take > n) take = n;
        memcpy(c->in + c->in_len, p, take);
        c->in_len += take;
        p += take;
        n -= take;
    }
}


#ifdef __cplusplus
}
#endif

#endif /* !_WIN32 */
