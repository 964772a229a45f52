/* ============================================================================
 * Rendezvous: the environment conventions and the built-in TCP store.
 *
 * Rank 0 runs the server on a thread of its own: one poll() loop over the listening
 * sockets, a wake-up pipe and every connection, all non-blocking, so a client that stalls
 * or sends garbage holds nobody up. Every rank, rank 0 included, is a client with one
 * blocking-with-deadline connection.
 *
 * Wire format (all integers big-endian; docs/rendezvous.md has the full description):
 *   server hello    40 B  "DTRZ" u32 version  nonce_s[32]
 *   client auth     80 B  "DTRA" u32 version  u32 rank  u32 world  nonce_c[32]  mac[32]
 *                         mac = HMAC-SHA256(secret, "dtr-rdzv-1 join" || nonce_s || auth[0..48))
 *   server welcome  40 B  "DTRW" u32 status  mac[32]
 *                         mac = HMAC-SHA256(secret, "dtr-rdzv-1 welcome" || nonce_c || nonce_s
 *                               || welcome[0..8)), zero when the status is a refusal
 *   request         12 B  u8 op  u8 0  u16 key_len  u32 value_len  u32 id,  then key, value
 *   reply           12 B  u8 status  u8 0  u16 0  u32 value_len  u32 id,  then value
 * The server reads exactly 80 bytes from a new connection and checks the MAC before it
 * looks at any field. Every length is checked against its bound as soon as its header is
 * complete, before a byte of the body is buffered; a message that breaks a rule closes
 * that connection (the reason is logged) and nothing else.
 *
 * The server logic (dtr__rdzv_server_*, dtr__rdzv_conn_*) works on in-memory buffers and
 * knows nothing of sockets, so tests/fuzz/fuzz_rdzv.c drives it directly.
 *
 * Portability: POSIX sockets, poll, pthreads. Only interfaces that glibc and musl declare
 * under plain -std=c99 are required (the amalgamation cannot define feature-test macros
 * after the user's headers): getaddrinfo and clock_gettime are used when the headers
 * declare them (AI_PASSIVE, CLOCK_MONOTONIC), else numeric addresses go through
 * inet_pton, host names through gethostbyname (IPv4) and time through times().
 * Windows: the store reports DTR_UNSUPPORTED.
 * Uses dtr__hmac_* and dtr__ct_equal from src/comm/sha256.c (just before it in the
 * amalgamation).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_rdzv.h"
#include "../core/internal.h"

#include <limits.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- configuration and the environment (every platform) ---- */

dtr_rendezvous_config dtr_rendezvous_config_init(void) {
    dtr_rendezvous_config c;
    memset(&c, 0, sizeof c);
    c.world_size = 1;
    memcpy(c.master_addr, "127.0.0.1", 10);
    c.port = 29500;
    c.timeout_ms = 300000;
    c.log_level = DTR_LOG_WARN;
    return c;
}

/* Parses a whole string of decimal digits (no sign, no spaces) into [lo, hi]. */
static int dtr__rdzv_parse_uint(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    int64_t v = 0;
    if (!*s) return 0;
    for (; *s; s++) {
        int d = *s - '0';
        if (d < 0 || d > 9) return 0;
        if (v > (hi - d) / 10) return 0;
        v = v * 10 + d;
    }
    if (v < lo) return 0;
    *out = v;
    return 1;
}

/* The first non-empty variable among names[0..n); *which gets its name. */
static const char *dtr__rdzv_getenv(const char *const *names, int n, const char **which) {
    int i;
    for (i = 0; i < n; i++) {
        const char *v = getenv(names[i]);
        if (v && v[0]) {
            *which = names[i];
            return v;
        }
    }
    return NULL;
}

/* Reads an integer field from the first set variable of `names`. */
static dtr_result dtr__rdzv_env_int(const char *const *names, int n, int64_t lo, int64_t hi, int32_t *field,
                                    const char **which, char *err, size_t errlen) {
    const char *v = dtr__rdzv_getenv(names, n, which);
    int64_t x;
    if (!v) return DTR_OK;
    if (!dtr__rdzv_parse_uint(v, lo, hi, &x))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "rendezvous: %s='%.64s' is not a decimal integer in [%lld, %lld]", *which, v, (long long)lo,
                         (long long)hi);
    *field = (int32_t)x;
    return DTR_OK;
}

static dtr_result dtr__rdzv_env_str(const char *const *names, int n, char *field, const char **which, char *err,
                                    size_t errlen) {
    const char *v = dtr__rdzv_getenv(names, n, which);
    size_t len;
    if (!v) return DTR_OK;
    len = strlen(v);
    if (len >= DTR_RDZV_STR)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: %s is %lu bytes long; at most %d", *which,
                         (unsigned long)len, DTR_RDZV_STR - 1);
    memcpy(field, v, len + 1);
    return DTR_OK;
}

dtr_result dtr_rendezvous_config_from_env(dtr_rendezvous_config *cfg, char *err, size_t errlen) {
    static const char *const rank[] = {"DTR_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"};
    static const char *const world[] = {"DTR_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"};
    static const char *const lrank[] = {"DTR_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID",
                                        "OMPI_COMM_WORLD_LOCAL_RANK"};
    static const char *const lworld[] = {"DTR_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"};
    static const char *const addr[] = {"DTR_MASTER_ADDR", "MASTER_ADDR"};
    static const char *const port[] = {"DTR_MASTER_PORT", "MASTER_PORT"};
    static const char *const secret[] = {"DTR_SECRET"};
    static const char *const timeout[] = {"DTR_TIMEOUT_MS"};
    const char *rank_from = "the configuration", *world_from = "the configuration";
    const char *lrank_from = "the configuration", *lworld_from = "the configuration", *w = NULL;
    int32_t port_v = 0, timeout_v = 0;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!cfg) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "rendezvous: config is NULL");
    if ((r = dtr__rdzv_env_int(rank, 4, 0, INT32_MAX - 1, &cfg->rank, &rank_from, err, errlen)) != DTR_OK) return r;
    if ((r = dtr__rdzv_env_int(world, 4, 1, INT32_MAX, &cfg->world_size, &world_from, err, errlen)) != DTR_OK)
        return r;
    if ((r = dtr__rdzv_env_int(lrank, 4, 0, INT32_MAX - 1, &cfg->local_rank, &lrank_from, err, errlen)) != DTR_OK)
        return r;
    if ((r = dtr__rdzv_env_int(lworld, 3, 1, INT32_MAX, &cfg->local_world_size, &lworld_from, err, errlen)) !=
        DTR_OK)
        return r;
    if ((r = dtr__rdzv_env_str(addr, 2, cfg->master_addr, &w, err, errlen)) != DTR_OK) return r;
    if ((r = dtr__rdzv_env_str(secret, 1, cfg->secret, &w, err, errlen)) != DTR_OK) return r;
    port_v = cfg->port;
    if ((r = dtr__rdzv_env_int(port, 2, 1, 65535, &port_v, &w, err, errlen)) != DTR_OK) return r;
    cfg->port = port_v;
    timeout_v = cfg->timeout_ms;
    if ((r = dtr__rdzv_env_int(timeout, 1, 1, INT32_MAX, &timeout_v, &w, err, errlen)) != DTR_OK) return r;
    cfg->timeout_ms = timeout_v;
    if (cfg->rank >= cfg->world_size)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: rank %ld (from %s) is not below the world size %ld (from %s)",
                         (long)cfg->rank, rank_from, (long)cfg->world_size, world_from);
    if (cfg->local_world_size > 0 && cfg->local_rank >= cfg->local_world_size)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "rendezvous: local rank %ld (from %s) is not below the local world size %ld (from %s)",
                         (long)cfg->local_rank, lrank_from, (long)cfg->local_world_size, lworld_from);
    return DTR_OK;
}

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
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/times.h>
#include <sys/types.h>

/* ---- protocol constants ---- */

#define DTR__RDZV_VERSION 1u
#define DTR__RDZV_NONCE 32
#define DTR__RDZV_MAC 32
#define DTR__RDZV_HELLO_LEN 40
#define DTR__RDZV_AUTH_LEN 80
#define DTR__RDZV_AUTH_SIGNED 48    /* bytes of the auth message covered by its MAC */
#define DTR__RDZV_WELCOME_LEN 40
#define DTR__RDZV_HDR 12
#define DTR__RDZV_MAX_FRAME (DTR__RDZV_HDR + DTR_STORE_MAX_KEY + DTR_STORE_MAX_VALUE)

/* request ops */
enum { DTR__RDZV_SET = 1, DTR__RDZV_GET = 2, DTR__RDZV_ADD = 3, DTR__RDZV_CHECK = 4, DTR__RDZV_DEL = 5 };
/* reply status */
enum { DTR__RDZV_OK = 0, DTR__RDZV_NOT_FOUND = 1, DTR__RDZV_NOT_INTEGER = 2, DTR__RDZV_FULL = 3 };
/* welcome status */
enum { DTR__RDZV_W_OK = 0, DTR__RDZV_W_BAD_SECRET = 1, DTR__RDZV_W_BAD_RANK = 2, DTR__RDZV_W_BAD_VERSION = 3 };
/* (W_BAD_RANK: the rank is not below the world size, or the world sizes differ) */
/* connection states */
enum { DTR__RDZV_C_AUTH = 0, DTR__RDZV_C_READY = 1, DTR__RDZV_C_CLOSING = 2 };

static const char dtr__rdzv_join_label[] = "dtr-rdzv-1 join";
static const char dtr__rdzv_welcome_label[] = "dtr-rdzv-1 welcome";

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

/* Monotonic milliseconds. */
static int64_t dtr__rdzv_now_ms(void) {
#ifdef CLOCK_MONOTONIC
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) return (int64_t)ts.tv_sec * 1000 + (int64_t)(ts.tv_nsec / 1000000);
#endif
    {
        struct tms t;
        long hz = sysconf(_SC_CLK_TCK);
        int64_t ticks = (int64_t)times(&t);
        if (hz <= 0) hz = 100;
        return ticks / hz * 1000 + (ticks % hz) * 1000 / hz;
    }
}

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

dtr_result dtr__rdzv_server_init(dtr__rdzv_server *s, const dtr_rendezvous_config *cfg);
void dtr__rdzv_server_free(dtr__rdzv_server *s);
int dtr__rdzv_parse_header(const uint8_t *p, dtr__rdzv_req *req, char *why, size_t whylen);
dtr__rdzv_conn *dtr__rdzv_conn_open(dtr__rdzv_server *s, int fd, const char *peer);
void dtr__rdzv_conn_feed(dtr__rdzv_server *s, dtr__rdzv_conn *c, const uint8_t *p, size_t n);
size_t dtr__rdzv_conn_want(const dtr__rdzv_conn *c);
void dtr__rdzv_conn_close(dtr__rdzv_server *s, dtr__rdzv_conn *c);

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

/* The MAC of an auth message: HMAC(secret, join label || server nonce || auth[0..48)). */
static void dtr__rdzv_auth_mac(const char *secret, const uint8_t *snonce, const uint8_t *auth, uint8_t *mac) {
    dtr__hmac h;
    dtr__hmac_init(&h, secret, strlen(secret));
    dtr__hmac_update(&h, dtr__rdzv_join_label, sizeof dtr__rdzv_join_label - 1);
    dtr__hmac_update(&h, snonce, DTR__RDZV_NONCE);
    dtr__hmac_update(&h, auth, DTR__RDZV_AUTH_SIGNED);
    dtr__hmac_final(&h, mac);
}

/* The MAC of a welcome: HMAC(secret, welcome label || client nonce || server nonce || welcome[0..8)). */
static void dtr__rdzv_welcome_mac(const char *secret, const uint8_t *cnonce, const uint8_t *snonce,
                                  const uint8_t *welcome, uint8_t *mac) {
    dtr__hmac h;
    dtr__hmac_init(&h, secret, strlen(secret));
    dtr__hmac_update(&h, dtr__rdzv_welcome_label, sizeof dtr__rdzv_welcome_label - 1);
    dtr__hmac_update(&h, cnonce, DTR__RDZV_NONCE);
    dtr__hmac_update(&h, snonce, DTR__RDZV_NONCE);
    dtr__hmac_update(&h, welcome, 8);
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
    if (status == DTR__RDZV_W_OK) dtr__rdzv_welcome_mac(s->cfg.secret, cnonce, c->nonce, p, p + 8);
    else memset(p + 8, 0, DTR__RDZV_MAC);
    c->out_len += DTR__RDZV_WELCOME_LEN;
}

/* The 80-byte auth message: the MAC first, then the fields it covers. */
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
    dtr__rdzv_welcome(s, c, DTR__RDZV_W_OK, m + 16);
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

/* ======================================================================
 * Sockets: addresses, the server thread, the client.
 * ====================================================================*/

typedef struct dtr__rdzv_addr {
    struct sockaddr_storage ss;
    socklen_t len;
} dtr__rdzv_addr;

#define DTR__RDZV_MAX_ADDRS 8

/* "host:port" or "[v6]:port" of a socket address. */
static void dtr__rdzv_addr_str(const struct sockaddr *sa, char *buf, size_t cap) {
    char host[48];   /* INET6_ADDRSTRLEN is 46 */
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)(const void *)sa;
        if (!inet_ntop(AF_INET, &a->sin_addr, host, sizeof host)) snprintf(host, sizeof host, "?");
        snprintf(buf, cap, "%s:%u", host, (unsigned)ntohs(a->sin_port));
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)(const void *)sa;
        if (!inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host)) snprintf(host, sizeof host, "?");
        snprintf(buf, cap, "[%s]:%u", host, (unsigned)ntohs(a->sin6_port));
    } else {
        snprintf(buf, cap, "(family %d)", (int)sa->sa_family);
    }
}

static int dtr__rdzv_is_loopback(const dtr__rdzv_addr *a) {
    if (a->ss.ss_family == AF_INET) {
        const struct sockaddr_in *s4 = (const struct sockaddr_in *)(const void *)&a->ss;
        return (ntohl(s4->sin_addr.s_addr) >> 24) == 127;
    }
    if (a->ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)(const void *)&a->ss;
        return IN6_IS_ADDR_LOOPBACK(&s6->sin6_addr);
    }
    return 0;
}

static void dtr__rdzv_set_port(dtr__rdzv_addr *a, int port) {
    if (a->ss.ss_family == AF_INET) ((struct sockaddr_in *)(void *)&a->ss)->sin_port = htons((uint16_t)port);
    else if (a->ss.ss_family == AF_INET6) ((struct sockaddr_in6 *)(void *)&a->ss)->sin6_port = htons((uint16_t)port);
}

/* Resolves host (a name, an IPv4 or an IPv6 address, "[v6]" allowed) for TCP to `port`.
 * Returns the number of addresses (>= 1), or 0 with the reason in why; *retry is 1 when the
 * failure may be temporary. */
static int dtr__rdzv_resolve(const char *host_in, int port, dtr__rdzv_addr *out, int max, char *why, size_t whylen,
                             int *retry) {
    char host[DTR_RDZV_STR];
    size_t n = strlen(host_in);
    int count = 0;
    *retry = 0;
    if (n >= 2 && host_in[0] == '[' && host_in[n - 1] == ']') {
        memcpy(host, host_in + 1, n - 2);
        host[n - 2] = '\0';
    } else {
        snprintf(host, sizeof host, "%s", host_in);
    }
    if (!host[0]) {
        dtr__errf(why, whylen, DTR_INVALID_ARGUMENT, "empty master address");
        return 0;
    }
#ifdef AI_PASSIVE
    {
        struct addrinfo hints, *res = NULL, *ai;
        char portstr[16];
        int rc;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        snprintf(portstr, sizeof portstr, "%d", port);
        rc = getaddrinfo(host, portstr, &hints, &res);
        if (rc != 0) {
            *retry = rc == EAI_AGAIN;
            dtr__errf(why, whylen, DTR_IO_ERROR, "cannot resolve '%s': %s", host, gai_strerror(rc));
            return 0;
        }
        for (ai = res; ai && count < max; ai = ai->ai_next) {
            if ((ai->ai_family != AF_INET && ai->ai_family != AF_INET6) || ai->ai_addrlen > sizeof out[0].ss) continue;
            memset(&out[count], 0, sizeof out[count]);
            memcpy(&out[count].ss, ai->ai_addr, ai->ai_addrlen);
            out[count].len = (socklen_t)ai->ai_addrlen;
            count++;
        }
        freeaddrinfo(res);
    }
#else
    {
        struct sockaddr_in s4;
        struct sockaddr_in6 s6;
        memset(&s4, 0, sizeof s4);
        memset(&s6, 0, sizeof s6);
        if (inet_pton(AF_INET, host, &s4.sin_addr) == 1) {
            s4.sin_family = AF_INET;
            memset(&out[0], 0, sizeof out[0]);
            memcpy(&out[0].ss, &s4, sizeof s4);
            out[0].len = (socklen_t)sizeof s4;
            count = 1;
        } else if (inet_pton(AF_INET6, host, &s6.sin6_addr) == 1) {
            s6.sin6_family = AF_INET6;
            memset(&out[0], 0, sizeof out[0]);
            memcpy(&out[0].ss, &s6, sizeof s6);
            out[0].len = (socklen_t)sizeof s6;
            count = 1;
        } else {
            /* gethostbyname is not reentrant: one caller at a time, results copied out. */
            static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
            struct hostent *he;
            pthread_mutex_lock(&lock);
            he = gethostbyname(host);
            if (he && he->h_addrtype == AF_INET && he->h_length == 4) {
                int i;
                for (i = 0; he->h_addr_list[i] && count < max; i++) {
                    memset(&s4, 0, sizeof s4);
                    s4.sin_family = AF_INET;
                    memcpy(&s4.sin_addr, he->h_addr_list[i], 4);
                    memset(&out[count], 0, sizeof out[count]);
                    memcpy(&out[count].ss, &s4, sizeof s4);
                    out[count].len = (socklen_t)sizeof s4;
                    count++;
                }
            } else {
                *retry = h_errno == TRY_AGAIN;
            }
            pthread_mutex_unlock(&lock);
            if (!count) {
                dtr__errf(why, whylen, DTR_IO_ERROR,
                          "cannot resolve '%s' (IPv4 names only: this build has no getaddrinfo; use an address)",
                          host);
                return 0;
            }
        }
    }
#endif
    if (!count) {
        dtr__errf(why, whylen, DTR_IO_ERROR, "'%s' has no IPv4 or IPv6 address", host);
        return 0;
    }
    {
        int i;
        for (i = 0; i < count; i++) dtr__rdzv_set_port(&out[i], port);
    }
    return count;
}

static int dtr__rdzv_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return 0;
    (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    return 1;
}

static void dtr__rdzv_sockopts(int fd) {
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, (socklen_t)sizeof one);
#ifdef SO_NOSIGPIPE
    (void)setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, (socklen_t)sizeof one);
#endif
}

/* ---- the server thread (rank 0) ---- */

#define DTR__RDZV_MAX_LISTEN 4

typedef struct dtr__rdzv_host {
    dtr__rdzv_server core;
    int lfd[DTR__RDZV_MAX_LISTEN];
    int nlfd;
    int wake[2];                 /* write 'q' to stop now, 'd' to stop once no rank is connected */
    int64_t drain_deadline;      /* set before 'd' is written */
    pthread_t thread;
    int started;
    int port;
    struct pollfd *pfd;
    dtr__rdzv_conn **pconn;
    int pcap;
} dtr__rdzv_host;

static int dtr__rdzv_host_grow(dtr__rdzv_host *h, int n) {
    struct pollfd *p;
    dtr__rdzv_conn **c;
    int cap;
    if (n <= h->pcap) return 1;
    cap = h->pcap ? h->pcap : 32;
    while (cap < n) cap *= 2;
    p = (struct pollfd *)dtr__realloc(&h->core.cfg.alloc, h->pfd, (size_t)cap * sizeof *p);
    if (!p) return 0;
    h->pfd = p;
    c = (dtr__rdzv_conn **)dtr__realloc(&h->core.cfg.alloc, h->pconn, (size_t)cap * sizeof *c);
    if (!c) return 0;
    h->pconn = c;
    h->pcap = cap;
    return 1;
}

static void dtr__rdzv_accept(dtr__rdzv_host *h, int lfd) {
    dtr__rdzv_server *s = &h->core;
    int k;
    for (k = 0; k < 64; k++) {
        struct sockaddr_storage ss;
        socklen_t sl = (socklen_t)sizeof ss;
        char peer[64];
        dtr__rdzv_conn *c;
        int fd = accept(lfd, (struct sockaddr *)(void *)&ss, &sl);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                dtr__rdzv_log(&s->cfg, DTR_LOG_WARN, "rendezvous server: accept failed: %s", strerror(errno));
            return;
        }
        dtr__rdzv_addr_str((const struct sockaddr *)(const void *)&ss, peer, sizeof peer);
        if (!dtr__rdzv_nonblock(fd)) {
            close(fd);
            continue;
        }
        dtr__rdzv_sockopts(fd);
        c = dtr__rdzv_conn_open(s, fd, peer);
        if (!c) {
            s->refused++;
            dtr__rdzv_log(&s->cfg, DTR_LOG_WARN, "rendezvous server: refused %s: %d connections open (max_connections %d)",
                          peer, s->nconns, s->cfg.max_connections);
            close(fd);
            continue;
        }
        c->deadline_ms = dtr__rdzv_now_ms() + (s->cfg.timeout_ms < 30000 ? s->cfg.timeout_ms : 30000);
        dtr__rdzv_log(&s->cfg, DTR_LOG_DEBUG, "rendezvous server: connection from %s", peer);
    }
}

/* Sends what is queued; 0 when the connection is gone. */
static int dtr__rdzv_flush(dtr__rdzv_conn *c) {
    while (c->out_pos < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_pos, c->out_len - c->out_pos, DTR__RDZV_NOSIGNAL);
        if (k > 0) c->out_pos += (size_t)k;
        else if (k < 0 && errno == EINTR) continue;
        else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
        else return 0;
    }
    return 1;
}

static void *dtr__rdzv_thread(void *arg) {
    dtr__rdzv_host *h = (dtr__rdzv_host *)arg;
    dtr__rdzv_server *s = &h->core;
    uint8_t buf[16384];
    int draining = 0;
    for (;;) {
        int n = 0, i, nfixed, timeout = -1, rc, ready = 0;
        int64_t now = dtr__rdzv_now_ms();
        if (!dtr__rdzv_host_grow(h, 1 + h->nlfd + s->nconns)) {
            dtr__rdzv_sleep_ms(10);   /* out of memory for the poll set: try again shortly */
            continue;
        }
        h->pfd[n].fd = h->wake[0];
        h->pfd[n].events = POLLIN;
        h->pconn[n++] = NULL;
        for (i = 0; i < h->nlfd; i++) {
            h->pfd[n].fd = h->lfd[i];
            h->pfd[n].events = POLLIN;
            h->pconn[n++] = NULL;
        }
        nfixed = n;
        for (i = 0; i < s->nconns; i++) {
            dtr__rdzv_conn *c = s->conns[i];
            short ev = 0;
            if (c->out_pos < c->out_len) ev |= POLLOUT;
            else if (c->state != DTR__RDZV_C_CLOSING) ev |= POLLIN;
            if (c->state == DTR__RDZV_C_READY) ready++;
            if (c->state == DTR__RDZV_C_AUTH) {
                int64_t left = c->deadline_ms - now;
                int t = left <= 0 ? 0 : (left > INT_MAX ? INT_MAX : (int)left);
                if (timeout < 0 || t < timeout) timeout = t;
            }
            h->pfd[n].fd = c->fd;
            h->pfd[n].events = ev;
            h->pconn[n++] = c;
        }
        if (draining) {
            int t = dtr__rdzv_left_ms(h->drain_deadline);
            if (ready == 0 || t == 0) break;
            if (timeout < 0 || t < timeout) timeout = t;
        }
        rc = poll(h->pfd, (nfds_t)n, timeout);
        if (rc < 0) {
            if (errno == EINTR) continue;
            dtr__rdzv_log(&s->cfg, DTR_LOG_ERROR, "rendezvous server: poll failed: %s", strerror(errno));
            dtr__rdzv_sleep_ms(10);
            continue;
        }
        if (h->pfd[0].revents) {
            char cmd[16];
            ssize_t k = read(h->wake[0], cmd, sizeof cmd), j;
            for (j = 0; j < k; j++) {
                if (cmd[j] == 'q') return NULL;
                if (cmd[j] == 'd' && !draining) {
                    /* no new joins once the store is being destroyed: the port is free at once
                       for the next store, and a rank that opens that one cannot reach this
                       server, which only waits for its connected ranks to leave */
                    int l;
                    for (l = 0; l < h->nlfd; l++) close(h->lfd[l]);
                    h->nlfd = 0;
                    draining = 1;
                }
            }
        }
        for (i = 1; i < nfixed && !draining; i++)
            if (h->pfd[i].revents & POLLIN) dtr__rdzv_accept(h, h->pfd[i].fd);
        now = dtr__rdzv_now_ms();
        for (i = nfixed; i < n; i++) {
            dtr__rdzv_conn *c = h->pconn[i];
            short re = h->pfd[i].revents;
            int gone = 0;
            if (re & POLLNVAL) gone = 1;
            if (!gone && (re & (POLLOUT | POLLHUP | POLLERR)) && c->out_pos < c->out_len && !dtr__rdzv_flush(c))
                gone = 1;
            if (!gone && (re & (POLLHUP | POLLERR)) && !(h->pfd[i].events & POLLIN) && c->out_pos < c->out_len)
                gone = 1;   /* cannot be written and is not read: nothing more to do with it */
            if (!gone && (re & (POLLIN | POLLHUP | POLLERR)) && (h->pfd[i].events & POLLIN)) {
                size_t want = dtr__rdzv_conn_want(c);
                ssize_t k;
                if (want > sizeof buf) want = sizeof buf;
                if (want == 0) want = 1;   /* closing: only notice the peer's end */
                k = recv(c->fd, buf, want, 0);
                if (k > 0) {
                    if (c->state != DTR__RDZV_C_CLOSING) dtr__rdzv_conn_feed(s, c, buf, (size_t)k);
                } else if (k == 0 || (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) {
                    if (c->state == DTR__RDZV_C_AUTH && c->in_len > 0) {
                        s->refused++;
                        dtr__rdzv_log(&s->cfg, DTR_LOG_WARN,
                                      "rendezvous server: refused %s: closed after %lu bytes of an incomplete join message",
                                      c->peer, (unsigned long)c->in_len);
                    } else if (c->state == DTR__RDZV_C_READY) {
                        dtr__rdzv_log(&s->cfg, DTR_LOG_DEBUG, "rendezvous server: rank %ld (%s) disconnected",
                                      (long)c->rank, c->peer);
                    }
                    gone = 1;
                }
            }
            if (!gone && c->state == DTR__RDZV_C_AUTH && now >= c->deadline_ms) {
                dtr__rdzv_refuse(s, c, DTR_LOG_WARN, "no valid join message within %d ms (%lu bytes received)",
                                 s->cfg.timeout_ms < 30000 ? s->cfg.timeout_ms : 30000, (unsigned long)c->in_len);
                gone = 1;
            }
            if (!gone && c->state == DTR__RDZV_C_CLOSING) {
                if (c->out_pos < c->out_len) (void)dtr__rdzv_flush(c);   /* best effort: the refusal */
                gone = 1;
            }
            if (gone) dtr__rdzv_conn_close(s, c);
        }
        /* Replies queued on other connections (woken waiters) go out on the next round. */
    }
    return NULL;
}

static void dtr__rdzv_host_free(dtr__rdzv_host *h) {
    int i;
    for (i = 0; i < h->nlfd; i++) close(h->lfd[i]);
    if (h->wake[0] >= 0) close(h->wake[0]);
    if (h->wake[1] >= 0) close(h->wake[1]);
    dtr__rdzv_free(&h->core.cfg, h->pfd);
    dtr__rdzv_free(&h->core.cfg, h->pconn);
    {
        dtr_allocation_callbacks a = h->core.cfg.alloc;
        dtr__rdzv_server_free(&h->core);
        dtr__free(&a, h);
    }
}

static void dtr__rdzv_host_stop(dtr__rdzv_host *h, char cmd, int64_t deadline) {
    if (h->started) {
        h->drain_deadline = deadline;
        while (write(h->wake[1], &cmd, 1) < 0 && errno == EINTR) {
        }
        pthread_join(h->thread, NULL);
        h->started = 0;
    }
    dtr__rdzv_host_free(h);
}

/* Binds and listens: on each loopback address of master_addr when all its addresses are
 * loopback, else on the IPv6 wildcard (dual stack) or, without IPv6, the IPv4 wildcard. */
static dtr_result dtr__rdzv_host_start(const dtr_rendezvous_config *cfg, dtr__rdzv_host **out, int *port_out,
                                       char *err, size_t errlen) {
    dtr__rdzv_addr addrs[DTR__RDZV_MAX_ADDRS], bind_to[DTR__RDZV_MAX_LISTEN];
    char why[300];
    int n, nb = 0, i, retry, all_loop = 1, port = cfg->port, last_errno = 0;
    dtr__rdzv_host *h;
    dtr_result r;
    *out = NULL;
    n = dtr__rdzv_resolve(cfg->master_addr, port, addrs, DTR__RDZV_MAX_ADDRS, why, sizeof why, &retry);
    if (n == 0)
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: master address: %s", why);
    for (i = 0; i < n; i++) all_loop &= dtr__rdzv_is_loopback(&addrs[i]);
    if (all_loop) {
        for (i = 0; i < n && nb < DTR__RDZV_MAX_LISTEN; i++) {
            int j, dup = 0;
            for (j = 0; j < nb; j++)
                if (bind_to[j].len == addrs[i].len && memcmp(&bind_to[j].ss, &addrs[i].ss, addrs[i].len) == 0) dup = 1;
            if (!dup) bind_to[nb++] = addrs[i];
        }
    } else {
        struct sockaddr_in6 s6;
        struct sockaddr_in s4;
        memset(&s6, 0, sizeof s6);
        s6.sin6_family = AF_INET6;
        s6.sin6_addr = in6addr_any;
        memset(&bind_to[0], 0, sizeof bind_to[0]);
        memcpy(&bind_to[0].ss, &s6, sizeof s6);
        bind_to[0].len = (socklen_t)sizeof s6;
        memset(&s4, 0, sizeof s4);
        s4.sin_family = AF_INET;
        s4.sin_addr.s_addr = htonl(INADDR_ANY);
        memset(&bind_to[1], 0, sizeof bind_to[1]);
        memcpy(&bind_to[1].ss, &s4, sizeof s4);
        bind_to[1].len = (socklen_t)sizeof s4;
        nb = 2;   /* the second only when the first fails */
    }
    h = (dtr__rdzv_host *)dtr__calloc(&cfg->alloc, sizeof *h);
    if (!h) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous rank 0: out of memory");
    h->wake[0] = h->wake[1] = -1;
    if ((r = dtr__rdzv_server_init(&h->core, cfg)) != DTR_OK) {
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, r, "rendezvous rank 0: out of memory");
    }
    for (i = 0; i < nb; i++) {
        int fd, one = 1;
        dtr__rdzv_addr a = bind_to[i];
        if (!all_loop && h->nlfd > 0) break;   /* wildcard: the IPv6 socket took IPv4 too */
        dtr__rdzv_set_port(&a, port);
        fd = socket(a.ss.ss_family, SOCK_STREAM, 0);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, (socklen_t)sizeof one);
        if (a.ss.ss_family == AF_INET6) {
            int v6only = all_loop ? 1 : 0;
            (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, (socklen_t)sizeof v6only);
        }
        if (bind(fd, (struct sockaddr *)(void *)&a.ss, a.len) != 0 || listen(fd, SOMAXCONN) != 0 ||
            !dtr__rdzv_nonblock(fd)) {
            last_errno = errno;
            close(fd);
            if (all_loop && h->nlfd == 0 && i == 0 && last_errno == EADDRINUSE) break;
            continue;
        }
        if (port == 0) {   /* the port the kernel chose: the other sockets take the same one */
            struct sockaddr_storage ss;
            socklen_t sl = (socklen_t)sizeof ss;
            if (getsockname(fd, (struct sockaddr *)(void *)&ss, &sl) == 0) {
                if (ss.ss_family == AF_INET) port = ntohs(((struct sockaddr_in *)(void *)&ss)->sin_port);
                else if (ss.ss_family == AF_INET6) port = ntohs(((struct sockaddr_in6 *)(void *)&ss)->sin6_port);
            }
        }
        h->lfd[h->nlfd++] = fd;
    }
    if (h->nlfd == 0) {
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: cannot listen on %s port %d: %s%s",
                         all_loop ? cfg->master_addr : "every interface", cfg->port, strerror(last_errno),
                         last_errno == EADDRINUSE ? " (another job on this port? choose another DTR_MASTER_PORT)" : "");
    }
    if (pipe(h->wake) != 0) {
        h->wake[0] = h->wake[1] = -1;
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: pipe: %s", strerror(errno));
    }
    (void)fcntl(h->wake[0], F_SETFD, FD_CLOEXEC);
    (void)fcntl(h->wake[1], F_SETFD, FD_CLOEXEC);
    h->port = port;
    if (pthread_create(&h->thread, NULL, dtr__rdzv_thread, h) != 0) {
        dtr__rdzv_host_free(h);
        return dtr__errf(err, errlen, DTR_IO_ERROR, "rendezvous rank 0: cannot start the server thread");
    }
    h->started = 1;
    *port_out = port;
    *out = h;
    return DTR_OK;
}

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
    char err[768];
};

/* Sends all n bytes before the deadline. DTR_TIMEOUT or DTR_PEER_FAILED (errno in *e). */
static dtr_result dtr__rdzv_send_all(int fd, const void *buf, size_t n, int64_t deadline, int *e) {
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
            int left = dtr__rdzv_left_ms(deadline), rc;
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
static dtr_result dtr__rdzv_recv_all(int fd, void *buf, size_t n, int64_t deadline, size_t *got, int *e) {
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
            int left = dtr__rdzv_left_ms(deadline), rc;
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

static const char *dtr__rdzv_errno_str(int e) { return e ? strerror(e) : "connection closed by the server"; }

/* Records the store's message (and logs it at ERROR); returns code. */
static dtr_result dtr__rdzv_fail(dtr_store *st, dtr_result code, const char *fmt, ...) DTR__PRINTF(3, 4);
static dtr_result dtr__rdzv_fail(dtr_store *st, dtr_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->err, sizeof st->err, fmt, ap);
    va_end(ap);
    dtr__rdzv_log(&st->cfg, DTR_LOG_ERROR, "%s", st->err);
    return code;
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
    dtr__rdzv_random(auth + 16, DTR__RDZV_NONCE);
    dtr__rdzv_auth_mac(st->cfg.secret, hello + 8, auth, auth + DTR__RDZV_AUTH_SIGNED);
    r = dtr__rdzv_send_all(fd, auth, sizeof auth, deadline, &e);
    if (r == DTR_OK) r = dtr__rdzv_recv_all(fd, wel, sizeof wel, deadline, &got, &e);
    if (r != DTR_OK) {
        close(fd);
        return dtr__errf(why, whylen, r, "during the handshake: %s",
                         r == DTR_TIMEOUT ? "no answer" : dtr__rdzv_errno_str(e));
    }
    status = dtr__rdzv_get32(wel + 4);
    if (memcmp(wel, "DTRW", 4) != 0 || status > DTR__RDZV_W_BAD_VERSION) {
        close(fd);
        *fatal = 1;
        return dtr__errf(why, whylen, DTR_PEER_FAILED, "malformed answer to the join message");
    }
    if (status != DTR__RDZV_W_OK) {
        close(fd);
        *fatal = 1;
        if (status == DTR__RDZV_W_BAD_SECRET)
            return dtr__errf(why, whylen, DTR_INVALID_ARGUMENT,
                             "the server refused the secret (DTR_SECRET must be the same on every rank)");
        if (status == DTR__RDZV_W_BAD_RANK)
            return dtr__errf(why, whylen, DTR_INVALID_ARGUMENT,
                             "the server refused rank %ld of a world of %ld (rank 0 has another world size)",
                             (long)st->cfg.rank, (long)st->cfg.world_size);
        return dtr__errf(why, whylen, DTR_VERSION_MISMATCH, "the server refused this protocol version");
    }
    dtr__rdzv_welcome_mac(st->cfg.secret, auth + 16, hello + 8, wel, mac);
    if (!dtr__ct_equal(mac, wel + 8, DTR__RDZV_MAC)) {
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
    if (cfg->timeout_ms < 0 || cfg->max_keys < 0 || cfg->max_connections < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "rendezvous: negative timeout_ms, max_keys or max_connections");
    st = (dtr_store *)dtr__calloc(a, sizeof *st);
    if (!st) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "rendezvous: out of memory");
    st->cfg = *cfg;
    if (st->cfg.timeout_ms == 0) st->cfg.timeout_ms = 300000;
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

void dtr_store_destroy(dtr_store *st) {
    dtr_allocation_callbacks a;
    if (!st) return;
    dtr__rdzv_close_client(st);
    if (st->host) dtr__rdzv_host_stop(st->host, 'd', dtr__rdzv_now_ms() + st->cfg.timeout_ms);
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
    r = dtr__rdzv_send_all(st->fd, hdr, DTR__RDZV_HDR + klen, deadline, &e);
    if (r == DTR_OK && len) r = dtr__rdzv_send_all(st->fd, value, len, deadline, &e);
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
        r = dtr__rdzv_recv_all(st->fd, rh, sizeof rh, deadline, &got, &e);
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
            if (keep) r = dtr__rdzv_recv_all(st->fd, buf, keep, deadline, &got, &e);
            for (off = keep; r == DTR_OK && off < rlen; off += got) {
                size_t chunk = rlen - off < sizeof sink ? rlen - off : sizeof sink;
                r = dtr__rdzv_recv_all(st->fd, sink, chunk, deadline, &got, &e);
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
