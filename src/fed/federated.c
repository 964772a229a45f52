/* ============================================================================
 * Federated learning (src/public/api_fed.h): the server's protocol logic on memory buffers
 * (tests/fuzz/fuzz_fed.c drives it directly), the server's socket loop and rounds
 * (aggregation, checks, server optimizers, checkpoint), and the client.
 *
 * Reuses the rendezvous code that comes before it in the amalgamation: integers on the
 * wire, nonces, the clock and logging (wire.c), HMAC-SHA256 and the constant-time compare
 * (sha256.c), address resolution and socket options (server.c), sends and receives with a
 * deadline (client.c). The framing follows the store's rules (every length checked against
 * its bound as soon as its header is in, before a byte of the body is buffered) but
 * carries model-sized bodies and a MAC per message, so it is its own format:
 *
 *   server hello    40 B  "DTFZ" u32 version  nonce_s[32]
 *   client join     88 B  "DTFJ" u32 version  u64 client_id  u64 numel  nonce_c[32]  mac[32]
 *                         mac = HMAC(secret, "dtr-fed-1 join" || nonce_s || join[0..56))
 *   server welcome  56 B  "DTFW" u32 status  u64 round  u64 numel  mac[32]
 *                         mac = HMAC(secret, "dtr-fed-1 welcome" || nonce_c || nonce_s || welcome[0..24))
 *   session key     HMAC(secret, "dtr-fed-1 session" || nonce_s || nonce_c)
 *   message         40 B header: u8 type  u8 codec  u16 0  u32 epochs  u64 round  u64 task  u64 arg
 *                   u64 len;  then len bytes;  then mac[32] = HMAC(session key, direction ||
 *                   u64 seq || header || SHA-256(body)), seq counting the messages of that
 *                   direction from 0.
 *   TASK (server)   body: the weights (numel values in codec); arg = mu bits << 32 | lr bits
 *   UPDATE (client) body: the update (numel values in codec); arg = samples; task echoes the task
 *   BYE (either)    no body
 * Integers are big-endian; float values little-endian (IEEE-754 f32 or bf16).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_rdzv.h"
#include "../public/api_fed.h"
#include "../core/internal.h"

#include <math.h>

#if defined(_WIN32)
dtr_fed_server_config dtr_fed_server_config_init(void) {
    dtr_fed_server_config c;
    memset(&c, 0, sizeof c);
    return c;
}
dtr_fed_client_config dtr_fed_client_config_init(void) {
    dtr_fed_client_config c;
    memset(&c, 0, sizeof c);
    return c;
}
dtr_result dtr_fed_server_create(const dtr_fed_server_config *cfg, const float *weights, int64_t numel,
                                 dtr_fed_server **out, char *err, size_t errlen) {
    (void)cfg; (void)weights; (void)numel;
    if (out) *out = NULL;
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "federated: not supported on Windows");
}
void dtr_fed_server_destroy(dtr_fed_server *s) { (void)s; }
dtr_result dtr_fed_server_wait_clients(dtr_fed_server *s, int n, int t) { (void)s; (void)n; (void)t; return DTR_UNSUPPORTED; }
dtr_result dtr_fed_server_round(dtr_fed_server *s, dtr_fed_round_stats *st) { (void)s; (void)st; return DTR_UNSUPPORTED; }
const float *dtr_fed_server_weights(const dtr_fed_server *s) { (void)s; return NULL; }
int64_t dtr_fed_server_round_index(const dtr_fed_server *s) { (void)s; return -1; }
int dtr_fed_server_live_clients(const dtr_fed_server *s) { (void)s; return -1; }
int dtr_fed_server_port(const dtr_fed_server *s) { (void)s; return 0; }
const char *dtr_fed_server_last_error(const dtr_fed_server *s) { (void)s; return "federated: not supported on Windows"; }
dtr_result dtr_fed_client_create(const dtr_fed_client_config *cfg, int64_t numel, dtr_fed_client **out, char *err,
                                 size_t errlen) {
    (void)cfg; (void)numel;
    if (out) *out = NULL;
    return dtr__errf(err, errlen, DTR_UNSUPPORTED, "federated: not supported on Windows");
}
void dtr_fed_client_destroy(dtr_fed_client *c) { (void)c; }
dtr_result dtr_fed_client_next(dtr_fed_client *c, float *w, dtr_fed_task *t) { (void)c; (void)w; (void)t; return DTR_UNSUPPORTED; }
dtr_result dtr_fed_client_send(dtr_fed_client *c, const float *d, uint64_t n) { (void)c; (void)d; (void)n; return DTR_UNSUPPORTED; }
dtr_result dtr_fed_client_send_weights(dtr_fed_client *c, const float *w, uint64_t n) { (void)c; (void)w; (void)n; return DTR_UNSUPPORTED; }
const char *dtr_fed_client_last_error(const dtr_fed_client *c) { (void)c; return "federated: not supported on Windows"; }
#else

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DTR__FED_VERSION 1u
#define DTR__FED_HELLO 40
#define DTR__FED_JOIN 88
#define DTR__FED_JOIN_SIGNED 56
#define DTR__FED_WELCOME 56
#define DTR__FED_WELCOME_SIGNED 24
#define DTR__FED_HDR 40
#define DTR__FED_MAC 32
#define DTR__FED_MAX_NUMEL ((int64_t)1 << 31)

enum { DTR__FED_TASK = 1, DTR__FED_UPDATE = 2, DTR__FED_BYE = 3 };
enum { DTR__FED_W_OK = 0, DTR__FED_W_BAD_SECRET = 1, DTR__FED_W_BAD_SHAPE = 2, DTR__FED_W_BAD_VERSION = 3,
       DTR__FED_W_FULL = 4 };
enum { DTR__FED_C_AUTH = 0, DTR__FED_C_LIVE = 1, DTR__FED_C_CLOSING = 2 };

/* A parsed message header. */
typedef struct dtr__fed_hdr {
    int type, codec;
    uint32_t epochs;
    uint64_t round, task, arg, len;
} dtr__fed_hdr;

/* One connection of the server. */
typedef struct dtr__fed_conn {
    int fd;                          /* -1 when driven from memory */
    int state;                       /* DTR__FED_C_* */
    uint64_t id;                     /* client id once joined */
    char peer[64];
    int64_t deadline_ms;             /* join deadline */
    uint8_t nonce[32];               /* the server's challenge */
    uint8_t key[32];                 /* session key */
    uint64_t seq_in, seq_out;
    uint8_t *in;                     /* the message being received */
    size_t in_len, in_cap, frame_len;
    uint8_t *out;                    /* bytes not yet sent: out[out_pos .. out_len) */
    size_t out_pos, out_len, out_cap;
    int64_t task;                    /* task id sent to it and not answered; -1: idle */
    int slot;                        /* its slot in the current attempt, or -1 */
} dtr__fed_conn;

/* The server: protocol state (on memory) and sockets. */
typedef struct dtr__fed_core {
    dtr_fed_server_config cfg;       /* defaults resolved */
    int64_t numel;
    int64_t round;                   /* rounds completed */
    uint64_t task_seq;               /* last task id issued */
    dtr__fed_conn **conns;
    int nconns, cap_conns;
    /* the current attempt */
    uint64_t cur_task;               /* 0: no attempt running */
    int nslots;
    float *slots;                    /* nslots x numel decoded updates */
    uint64_t *slot_samples;          /* 0: empty */
    int *slot_clipped;
    dtr_fed_round_stats st;          /* counters of the running round */
    char err[512];
} dtr__fed_core;

DTR__PRIVATE dtr_result dtr__fed_core_init(dtr__fed_core *s, const dtr_fed_server_config *cfg, int64_t numel, char *err,
                                           size_t errlen);
DTR__PRIVATE void dtr__fed_core_free(dtr__fed_core *s);
DTR__PRIVATE int dtr__fed_parse_header(const uint8_t *p, int64_t numel, dtr__fed_hdr *h, char *why, size_t whylen);
DTR__PRIVATE dtr__fed_conn *dtr__fed_conn_open(dtr__fed_core *s, int fd, const char *peer);
DTR__PRIVATE void dtr__fed_conn_feed(dtr__fed_core *s, dtr__fed_conn *c, const uint8_t *p, size_t n);
DTR__PRIVATE void dtr__fed_conn_close(dtr__fed_core *s, dtr__fed_conn *c);
DTR__PRIVATE void dtr__fed_join_mac(const char *secret, const uint8_t *snonce, const uint8_t *join, uint8_t *mac);
DTR__PRIVATE void dtr__fed_session_key(const char *secret, const uint8_t *snonce, const uint8_t *cnonce, uint8_t *key);
DTR__PRIVATE void dtr__fed_frame_mac(const uint8_t *key, int dir, uint64_t seq, const uint8_t *hdr, const uint8_t *body,
                                     size_t len, uint8_t *mac);
DTR__PRIVATE void dtr__fed_put_header(uint8_t *p, const dtr__fed_hdr *h);

/* strnlen, which plain C99 lacks. */
static size_t dtr__fed_slen(const char *s, size_t cap) {
    const char *z = (const char *)memchr(s, 0, cap);
    return z ? (size_t)(z - s) : cap;
}

static const char dtr__fed_join_label[] = "dtr-fed-1 join";
static const char dtr__fed_welcome_label[] = "dtr-fed-1 welcome";
static const char dtr__fed_session_label[] = "dtr-fed-1 session";

/* ---- MACs ---- */

void dtr__fed_join_mac(const char *secret, const uint8_t *snonce, const uint8_t *join, uint8_t *mac) {
    dtr__hmac h;
    dtr__hmac_init(&h, secret, strlen(secret));
    dtr__hmac_update(&h, dtr__fed_join_label, sizeof dtr__fed_join_label - 1);
    dtr__hmac_update(&h, snonce, 32);
    dtr__hmac_update(&h, join, DTR__FED_JOIN_SIGNED);
    dtr__hmac_final(&h, mac);
}

static void dtr__fed_welcome_mac(const char *secret, const uint8_t *cnonce, const uint8_t *snonce, const uint8_t *wel,
                                 uint8_t *mac) {
    dtr__hmac h;
    dtr__hmac_init(&h, secret, strlen(secret));
    dtr__hmac_update(&h, dtr__fed_welcome_label, sizeof dtr__fed_welcome_label - 1);
    dtr__hmac_update(&h, cnonce, 32);
    dtr__hmac_update(&h, snonce, 32);
    dtr__hmac_update(&h, wel, DTR__FED_WELCOME_SIGNED);
    dtr__hmac_final(&h, mac);
}

void dtr__fed_session_key(const char *secret, const uint8_t *snonce, const uint8_t *cnonce, uint8_t *key) {
    dtr__hmac h;
    dtr__hmac_init(&h, secret, strlen(secret));
    dtr__hmac_update(&h, dtr__fed_session_label, sizeof dtr__fed_session_label - 1);
    dtr__hmac_update(&h, snonce, 32);
    dtr__hmac_update(&h, cnonce, 32);
    dtr__hmac_final(&h, key);
}

/* dir: 0 server to client, 1 client to server. */
void dtr__fed_frame_mac(const uint8_t *key, int dir, uint64_t seq, const uint8_t *hdr, const uint8_t *body, size_t len,
                        uint8_t *mac) {
    uint8_t pre[9], digest[32];
    dtr__hmac h;
    pre[0] = (uint8_t)dir;
    dtr__rdzv_put64(pre + 1, seq);
    dtr__sha256_once(body, len, digest);
    dtr__hmac_init(&h, key, 32);
    dtr__hmac_update(&h, pre, sizeof pre);
    dtr__hmac_update(&h, hdr, DTR__FED_HDR);
    dtr__hmac_update(&h, digest, sizeof digest);
    dtr__hmac_final(&h, mac);
}

/* ---- codecs ---- */

static size_t dtr__fed_codec_size(int codec) { return codec == DTR_FED_BF16 ? 2 : 4; }

static void dtr__fed_encode(int codec, const float *x, int64_t n, uint8_t *out) {
    if (codec == DTR_FED_BF16) dtr__f32_to_bf16_n((uint16_t *)(void *)out, x, (size_t)n);
    else memcpy(out, x, (size_t)n * sizeof(float));
}

static void dtr__fed_decode(int codec, const uint8_t *in, int64_t n, float *x) {
    if (codec == DTR_FED_BF16) {
        int64_t i;
        for (i = 0; i < n; i++) {
            uint16_t b;
            memcpy(&b, in + 2 * i, 2);
            x[i] = dtr_bf16_to_f32(b);
        }
    } else {
        memcpy(x, in, (size_t)n * sizeof(float));
    }
}

void dtr__fed_put_header(uint8_t *p, const dtr__fed_hdr *h) {
    p[0] = (uint8_t)h->type;
    p[1] = (uint8_t)h->codec;
    p[2] = p[3] = 0;
    dtr__rdzv_put32(p + 4, h->epochs);
    dtr__rdzv_put64(p + 8, h->round);
    dtr__rdzv_put64(p + 16, h->task);
    dtr__rdzv_put64(p + 24, h->arg);
    dtr__rdzv_put64(p + 32, h->len);
}

/* Parses and bounds-checks a header: returns 1, or 0 with the reason. */
int dtr__fed_parse_header(const uint8_t *p, int64_t numel, dtr__fed_hdr *h, char *why, size_t whylen) {
    h->type = p[0];
    h->codec = p[1];
    h->epochs = dtr__rdzv_get32(p + 4);
    h->round = dtr__rdzv_get64(p + 8);
    h->task = dtr__rdzv_get64(p + 16);
    h->arg = dtr__rdzv_get64(p + 24);
    h->len = dtr__rdzv_get64(p + 32);
    if (p[2] || p[3]) return snprintf(why, whylen, "reserved header bytes not zero"), 0;
    if (h->type < DTR__FED_TASK || h->type > DTR__FED_BYE)
        return snprintf(why, whylen, "unknown message type %d", h->type), 0;
    if (h->codec != DTR_FED_F32 && h->codec != DTR_FED_BF16)
        return snprintf(why, whylen, "unknown codec %d", h->codec), 0;
    if (h->type == DTR__FED_BYE && h->len != 0) return snprintf(why, whylen, "a goodbye with a body"), 0;
    if (h->type != DTR__FED_BYE && h->len != (uint64_t)numel * dtr__fed_codec_size(h->codec))
        return snprintf(why, whylen, "body of %llu bytes where %lld values of %u bytes were due (wrong shape)",
                        (unsigned long long)h->len, (long long)numel, (unsigned)dtr__fed_codec_size(h->codec)), 0;
    return 1;
}

/* ---- the server core ---- */

static void dtr__fed_log(const dtr_fed_server_config *cfg, dtr_log_level level, const char *fmt, ...) DTR__PRINTF(3, 4);
static void dtr__fed_log(const dtr_fed_server_config *cfg, dtr_log_level level, const char *fmt, ...) {
    char msg[640];
    va_list ap;
    if (!cfg->log || level > cfg->log_level) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    cfg->log(cfg->log_user, level, msg);
}

static dtr_result dtr__fed_check_config(dtr_fed_server_config *c, char *err, size_t errlen) {
    size_t sl = dtr__fed_slen(c->secret, sizeof c->secret);
    if (sl == 0 || sl >= sizeof c->secret)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "federated server: secret must be 1..255 bytes");
    if (c->port < 0 || c->port > 65535 || c->clients_per_round < 0 || c->min_updates < 0 || c->round_timeout_ms < 0 ||
        c->max_attempts < 0 || c->local_epochs < 0 || c->max_clients < 0 || c->checkpoint_every < 0 ||
        c->join_timeout_ms < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "federated server: a count, port or timeout is negative");
    if ((unsigned)c->aggregator > DTR_FED_TRIMMED_MEAN || (unsigned)c->server_opt > DTR_FED_OPT_ADAM ||
        (unsigned)c->codec > DTR_FED_BF16)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "federated server: unknown aggregator, server_opt or codec");
    if (!(c->trim_fraction >= 0.0f && c->trim_fraction < 0.5f))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "federated server: trim_fraction %g not in [0, 0.5)",
                         (double)c->trim_fraction);
    if (!(c->clip_norm >= 0.0f) || !(c->dp_noise_multiplier >= 0.0f) || !isfinite(c->mu) || c->mu < 0.0f)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "federated server: clip_norm, dp_noise_multiplier, mu must be >= 0");
    if (c->dp_noise_multiplier > 0.0f && c->clip_norm <= 0.0f)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "federated server: differential privacy (dp_noise_multiplier) needs clip_norm > 0");
    return DTR_OK;
}

static void dtr__fed_defaults(dtr_fed_server_config *c) {
    if (!c->bind_addr[0]) snprintf(c->bind_addr, sizeof c->bind_addr, "127.0.0.1");
    if (!c->clients_per_round) c->clients_per_round = 8;
    if (!c->min_updates) c->min_updates = 1;
    if (!c->round_timeout_ms) c->round_timeout_ms = 60000;
    if (!c->join_timeout_ms) c->join_timeout_ms = c->round_timeout_ms;
    if (!c->max_attempts) c->max_attempts = 3;
    if (!c->local_epochs) c->local_epochs = 1;
    if (c->max_update_norm == 0.0f) c->max_update_norm = 1e4f;
    if (c->server_lr == 0.0f) c->server_lr = c->server_opt == DTR_FED_OPT_ADAM ? 0.01f : 1.0f;
    if (c->beta1 == 0.0f) c->beta1 = 0.9f;
    if (c->beta2 == 0.0f) c->beta2 = 0.99f;
    if (c->eps == 0.0f) c->eps = 1e-3f;
    if (!c->checkpoint_every) c->checkpoint_every = 1;
    if (!c->max_clients) c->max_clients = 1024;
    if (c->min_updates > c->clients_per_round) c->min_updates = c->clients_per_round;
}

dtr_result dtr__fed_core_init(dtr__fed_core *s, const dtr_fed_server_config *cfg, int64_t numel, char *err,
                              size_t errlen) {
    dtr_result r;
    memset(s, 0, sizeof *s);
    s->cfg = *cfg;
    dtr__fed_defaults(&s->cfg);
    if ((r = dtr__fed_check_config(&s->cfg, err, errlen)) != DTR_OK) return r;
    if (numel < 1 || numel > DTR__FED_MAX_NUMEL)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "federated server: numel %lld not in 1..2^31",
                         (long long)numel);
    s->numel = numel;
    s->nslots = s->cfg.clients_per_round;
    s->slots = (float *)dtr__malloc(&s->cfg.alloc, (size_t)s->nslots * (size_t)numel * sizeof(float));
    s->slot_samples = (uint64_t *)dtr__calloc(&s->cfg.alloc, (size_t)s->nslots * sizeof(uint64_t));
    s->slot_clipped = (int *)dtr__calloc(&s->cfg.alloc, (size_t)s->nslots * sizeof(int));
    if (!s->slots || !s->slot_samples || !s->slot_clipped) {
        dtr__fed_core_free(s);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "federated server: out of memory for %d update slots",
                         cfg->clients_per_round);
    }
    return DTR_OK;
}

void dtr__fed_core_free(dtr__fed_core *s) {
    while (s->nconns > 0) dtr__fed_conn_close(s, s->conns[s->nconns - 1]);
    dtr__free(&s->cfg.alloc, s->conns);
    dtr__free(&s->cfg.alloc, s->slots);
    dtr__free(&s->cfg.alloc, s->slot_samples);
    dtr__free(&s->cfg.alloc, s->slot_clipped);
    s->conns = NULL;
    s->slots = NULL;
    s->slot_samples = NULL;
    s->slot_clipped = NULL;
}

static int dtr__fed_reserve(const dtr_allocation_callbacks *a, uint8_t **buf, size_t *cap, size_t need) {
    uint8_t *p;
    size_t c = *cap ? *cap : 256;
    if (need <= *cap) return 1;
    while (c < need) c *= 2;
    p = (uint8_t *)dtr__realloc(a, *buf, c);
    if (!p) return 0;
    *buf = p;
    *cap = c;
    return 1;
}

/* Queues bytes for the client; 0 (and the connection closing) when out of memory. */
static int dtr__fed_queue(dtr__fed_core *s, dtr__fed_conn *c, const void *p, size_t n) {
    if (c->out_pos == c->out_len) c->out_pos = c->out_len = 0;
    if (!dtr__fed_reserve(&s->cfg.alloc, &c->out, &c->out_cap, c->out_len + n)) {
        c->state = DTR__FED_C_CLOSING;
        return 0;
    }
    memcpy(c->out + c->out_len, p, n);
    c->out_len += n;
    s->st.bytes_sent += n;
    return 1;
}

/* Queues a message (header, body, MAC) for a live client. */
static int dtr__fed_queue_msg(dtr__fed_core *s, dtr__fed_conn *c, const dtr__fed_hdr *h, const uint8_t *body) {
    uint8_t hdr[DTR__FED_HDR], mac[DTR__FED_MAC];
    dtr__fed_put_header(hdr, h);
    dtr__fed_frame_mac(c->key, 0, c->seq_out++, hdr, body, (size_t)h->len, mac);
    return dtr__fed_queue(s, c, hdr, sizeof hdr) && (!h->len || dtr__fed_queue(s, c, body, (size_t)h->len)) &&
           dtr__fed_queue(s, c, mac, sizeof mac);
}

dtr__fed_conn *dtr__fed_conn_open(dtr__fed_core *s, int fd, const char *peer) {
    dtr__fed_conn *c;
    uint8_t hello[DTR__FED_HELLO];
    if (s->nconns >= s->cfg.max_clients) return NULL;
    if (s->nconns == s->cap_conns) {
        int cap = s->cap_conns ? 2 * s->cap_conns : 16;
        dtr__fed_conn **p = (dtr__fed_conn **)dtr__realloc(&s->cfg.alloc, s->conns, (size_t)cap * sizeof *p);
        if (!p) return NULL;
        s->conns = p;
        s->cap_conns = cap;
    }
    c = (dtr__fed_conn *)dtr__calloc(&s->cfg.alloc, sizeof *c);
    if (!c) return NULL;
    c->fd = fd;
    c->task = -1;
    c->slot = -1;
    snprintf(c->peer, sizeof c->peer, "%s", peer);
    dtr__rdzv_random(c->nonce, sizeof c->nonce);
    memcpy(hello, "DTFZ", 4);
    dtr__rdzv_put32(hello + 4, DTR__FED_VERSION);
    memcpy(hello + 8, c->nonce, 32);
    s->conns[s->nconns++] = c;
    if (!dtr__fed_queue(s, c, hello, sizeof hello)) c->state = DTR__FED_C_CLOSING;
    return c;
}

void dtr__fed_conn_close(dtr__fed_core *s, dtr__fed_conn *c) {
    int i;
    for (i = 0; i < s->nconns; i++)
        if (s->conns[i] == c) {
            s->conns[i] = s->conns[--s->nconns];
            break;
        }
    if (c->fd >= 0) close(c->fd);
    dtr__free(&s->cfg.alloc, c->in);
    dtr__free(&s->cfg.alloc, c->out);
    dtr__free(&s->cfg.alloc, c);
}

/* Closes the connection once what is queued is sent, logging why. */
static void dtr__fed_drop(dtr__fed_core *s, dtr__fed_conn *c, const char *why) {
    dtr__fed_log(&s->cfg, DTR_LOG_WARN, "federated server: dropped %s (client %llu): %s", c->peer,
                 (unsigned long long)c->id, why);
    if (c->state == DTR__FED_C_LIVE) s->st.dropped_clients++;
    c->state = DTR__FED_C_CLOSING;
    c->deadline_ms = dtr__rdzv_now_ms();
}

static void dtr__fed_welcome(dtr__fed_core *s, dtr__fed_conn *c, uint32_t status, const uint8_t *cnonce) {
    uint8_t w[DTR__FED_WELCOME];
    memset(w, 0, sizeof w);
    memcpy(w, "DTFW", 4);
    dtr__rdzv_put32(w + 4, status);
    dtr__rdzv_put64(w + 8, (uint64_t)s->round);
    dtr__rdzv_put64(w + 16, (uint64_t)s->numel);
    if (status == DTR__FED_W_OK) dtr__fed_welcome_mac(s->cfg.secret, cnonce, c->nonce, w, w + DTR__FED_WELCOME_SIGNED);
    (void)dtr__fed_queue(s, c, w, sizeof w);
}

/* The join message: check the MAC before any field, then version and size. */
static void dtr__fed_handle_join(dtr__fed_core *s, dtr__fed_conn *c, const uint8_t *m) {
    uint8_t mac[DTR__FED_MAC];
    int i;
    dtr__fed_join_mac(s->cfg.secret, c->nonce, m, mac);
    if (memcmp(m, "DTFJ", 4) != 0 || !dtr__ct_equal(mac, m + DTR__FED_JOIN_SIGNED, DTR__FED_MAC)) {
        dtr__fed_welcome(s, c, DTR__FED_W_BAD_SECRET, NULL);
        dtr__fed_drop(s, c, "join refused: wrong secret or not a dtrain federated client");
        return;
    }
    if (dtr__rdzv_get32(m + 4) != DTR__FED_VERSION) {
        dtr__fed_welcome(s, c, DTR__FED_W_BAD_VERSION, NULL);
        dtr__fed_drop(s, c, "join refused: another protocol version");
        return;
    }
    if (dtr__rdzv_get64(m + 16) != (uint64_t)s->numel) {
        dtr__fed_welcome(s, c, DTR__FED_W_BAD_SHAPE, NULL);
        dtr__fed_drop(s, c, "join refused: a model of another size");
        return;
    }
    c->id = dtr__rdzv_get64(m + 8);
    for (i = 0; i < s->nconns; i++)   /* a client that joins again replaces its old connection */
        if (s->conns[i] != c && s->conns[i]->state == DTR__FED_C_LIVE && s->conns[i]->id == c->id)
            dtr__fed_drop(s, s->conns[i], "the same client joined again");
    dtr__fed_session_key(s->cfg.secret, c->nonce, m + 24, c->key);
    dtr__fed_welcome(s, c, DTR__FED_W_OK, m + 24);
    c->state = DTR__FED_C_LIVE;
    dtr__fed_log(&s->cfg, DTR_LOG_INFO, "federated server: client %llu joined from %s", (unsigned long long)c->id, c->peer);
}

/* Decodes, checks and clips an update into its slot. */
static void dtr__fed_take_update(dtr__fed_core *s, dtr__fed_conn *c, const dtr__fed_hdr *h, const uint8_t *body) {
    float *u = s->slots + (size_t)c->slot * (size_t)s->numel;
    double ss = 0.0, norm;
    int64_t i;
    dtr__fed_decode(h->codec, body, s->numel, u);
    for (i = 0; i < s->numel; i++) ss += (double)u[i] * (double)u[i];
    norm = sqrt(ss);
    s->st.received++;
    if (!isfinite(norm) || h->arg == 0 || (s->cfg.max_update_norm > 0.0f && norm > (double)s->cfg.max_update_norm)) {
        s->st.rejected++;
        dtr__fed_log(&s->cfg, DTR_LOG_WARN, "federated server: rejected the update of client %llu: %s (norm %g, %llu samples)",
                     (unsigned long long)c->id, !isfinite(norm) ? "not finite" : h->arg == 0 ? "zero samples" : "norm too large",
                     norm, (unsigned long long)h->arg);
        return;
    }
    if (s->cfg.clip_norm > 0.0f && norm > (double)s->cfg.clip_norm) {
        float k = (float)((double)s->cfg.clip_norm / norm);
        for (i = 0; i < s->numel; i++) u[i] *= k;
        s->slot_clipped[c->slot] = 1;
    }
    s->slot_samples[c->slot] = h->arg > ((uint64_t)1 << 40) ? ((uint64_t)1 << 40) : h->arg;
}

static void dtr__fed_handle_msg(dtr__fed_core *s, dtr__fed_conn *c, const dtr__fed_hdr *h, const uint8_t *body,
                                const uint8_t *mac) {
    uint8_t want[DTR__FED_MAC];
    dtr__fed_frame_mac(c->key, 1, c->seq_in++, c->in, body, (size_t)h->len, want);
    if (!dtr__ct_equal(want, mac, DTR__FED_MAC)) {
        dtr__fed_drop(s, c, "a message failed its MAC (altered, replayed or not from this client)");
        return;
    }
    if (h->type == DTR__FED_BYE) {
        c->state = DTR__FED_C_CLOSING;
        return;
    }
    if (h->type != DTR__FED_UPDATE) {
        dtr__fed_drop(s, c, "a client sent a task");
        return;
    }
    if ((int64_t)h->task != c->task || c->task < 0) {
        if (c->task >= 0 && h->task < (uint64_t)c->task) return;   /* an older task's answer: ignore */
        dtr__fed_drop(s, c, "an update for a task it was not given");
        return;
    }
    c->task = -1;   /* answered: idle again */
    if (c->slot < 0 || h->task != s->cur_task) {
        s->st.late++;
        c->slot = -1;
        return;
    }
    dtr__fed_take_update(s, c, h, body);
    c->slot = -1;
}

/* Bytes still missing for the unit being received. */
static size_t dtr__fed_conn_want(const dtr__fed_conn *c) {
    if (c->state == DTR__FED_C_AUTH) return DTR__FED_JOIN - c->in_len;
    if (c->frame_len) return c->frame_len - c->in_len;
    return DTR__FED_HDR - c->in_len;
}

/* A unit (join, header or whole message) is complete in c->in. */
static void dtr__fed_conn_unit(dtr__fed_core *s, dtr__fed_conn *c) {
    dtr__fed_hdr h;
    char why[160];
    if (c->state == DTR__FED_C_AUTH) {
        c->in_len = 0;
        dtr__fed_handle_join(s, c, c->in);
        return;
    }
    if (!dtr__fed_parse_header(c->in, s->numel, &h, why, sizeof why)) {
        dtr__fed_drop(s, c, why);
        return;
    }
    if (!c->frame_len) {
        c->frame_len = DTR__FED_HDR + (size_t)h.len + DTR__FED_MAC;
        if (!dtr__fed_reserve(&s->cfg.alloc, &c->in, &c->in_cap, c->frame_len)) dtr__fed_drop(s, c, "out of memory");
        return;
    }
    c->frame_len = 0;
    c->in_len = 0;
    dtr__fed_handle_msg(s, c, &h, c->in + DTR__FED_HDR, c->in + DTR__FED_HDR + h.len);
}

void dtr__fed_conn_feed(dtr__fed_core *s, dtr__fed_conn *c, const uint8_t *p, size_t n) {
    s->st.bytes_received += n;
    while (n > 0 && c->state != DTR__FED_C_CLOSING) {
        size_t want = dtr__fed_conn_want(c), take = n < want ? n : want;
        if (!dtr__fed_reserve(&s->cfg.alloc, &c->in, &c->in_cap, c->in_len + take)) {
            dtr__fed_drop(s, c, "out of memory");
            return;
        }
        memcpy(c->in + c->in_len, p, take);
        c->in_len += take;
        p += take;
        n -= take;
        if (take == want) dtr__fed_conn_unit(s, c);
    }
}

/* ---- aggregation and the server optimizer ---- */

static int dtr__fed_cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Aggregates the m accepted slots (idx) into d. */
static void dtr__fed_aggregate(dtr__fed_core *s, const int *idx, int m, float *d, float *tmp) {
    int64_t i, numel = s->numel;
    int k, trim = s->cfg.aggregator == DTR_FED_TRIMMED_MEAN ? (int)((double)s->cfg.trim_fraction * m) : 0;
    if (s->cfg.aggregator == DTR_FED_MEAN) {
        double total = 0.0;
        for (k = 0; k < m; k++) total += (double)s->slot_samples[idx[k]];
        memset(d, 0, (size_t)numel * sizeof(float));
        for (k = 0; k < m; k++) {
            const float *u = s->slots + (size_t)idx[k] * (size_t)numel;
            float w = (float)((double)s->slot_samples[idx[k]] / total);
            for (i = 0; i < numel; i++) d[i] += w * u[i];
        }
        return;
    }
    for (i = 0; i < numel; i++) {
        double acc = 0.0;
        for (k = 0; k < m; k++) tmp[k] = s->slots[(size_t)idx[k] * (size_t)numel + (size_t)i];
        qsort(tmp, (size_t)m, sizeof(float), dtr__fed_cmp_float);
        if (s->cfg.aggregator == DTR_FED_MEDIAN) {
            d[i] = m % 2 ? tmp[m / 2] : 0.5f * (tmp[m / 2 - 1] + tmp[m / 2]);
            continue;
        }
        for (k = trim; k < m - trim; k++) acc += tmp[k];
        d[i] = (float)(acc / (double)(m - 2 * trim));
    }
}

/* Gaussian noise of the differential-privacy option, from a seeded splitmix stream. */
static void dtr__fed_add_noise(dtr__fed_core *s, const int *idx, int m, float *d) {
    double total = 0.0, top = 0.0, sigma;
    dtr_rng rng;
    int64_t i;
    int k;
    for (k = 0; k < m; k++) {
        double w = s->cfg.aggregator == DTR_FED_MEAN ? (double)s->slot_samples[idx[k]] : 1.0;
        total += w;
        if (w > top) top = w;
    }
    sigma = (double)s->cfg.dp_noise_multiplier * (double)s->cfg.clip_norm * top / total;
    dtr_rng_seed(&rng, s->cfg.seed ^ 0x5eedf00dull, (uint64_t)s->round * 2 + 1);
    for (i = 0; i < s->numel; i++) d[i] += (float)(sigma * (double)dtr_rng_normal(&rng));
}

/* The server state besides the weights: moments of momentum / Adam. */
typedef struct dtr__fed_opt {
    float *m, *v;
} dtr__fed_opt;

static void dtr__fed_apply(const dtr_fed_server_config *cfg, dtr__fed_opt *o, float *w, const float *d, int64_t n) {
    int64_t i;
    float lr = cfg->server_lr, b1 = cfg->beta1, b2 = cfg->beta2;
    for (i = 0; i < n; i++) {
        if (cfg->server_opt == DTR_FED_OPT_AVG) {
            w[i] += lr * d[i];
        } else if (cfg->server_opt == DTR_FED_OPT_MOMENTUM) {
            o->m[i] = b1 * o->m[i] + d[i];
            w[i] += lr * o->m[i];
        } else {
            o->m[i] = b1 * o->m[i] + (1.0f - b1) * d[i];
            o->v[i] = b2 * o->v[i] + (1.0f - b2) * d[i] * d[i];
            w[i] += lr * o->m[i] / (sqrtf(o->v[i]) + cfg->eps);
        }
    }
}

/* ======================================================================
 * The server: sockets and rounds.
 * ====================================================================*/

#define DTR__FED_MAX_LISTEN 4

struct dtr_fed_server {
    dtr__fed_core core;
    float *w;                        /* the global model */
    float *d, *tmp;                  /* aggregate; per-coordinate scratch (K floats) */
    dtr__fed_opt opt;
    uint8_t *wire;                   /* the weights encoded for a task */
    int *idx;
    int lfd[DTR__FED_MAX_LISTEN];
    int nlfd;
    int port;
    struct pollfd *pfd;
    int pcap;
    dtr_rng rng;
};

static void dtr__fed_accept(dtr_fed_server *srv, int lfd) {
    dtr__fed_core *s = &srv->core;
    int k;
    for (k = 0; k < 64; k++) {
        struct sockaddr_storage ss;
        socklen_t sl = (socklen_t)sizeof ss;
        char peer[64];
        dtr__fed_conn *c;
        int fd = accept(lfd, (struct sockaddr *)(void *)&ss, &sl);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            return;
        }
        dtr__rdzv_addr_str((const struct sockaddr *)(const void *)&ss, peer, sizeof peer);
        if (!dtr__rdzv_nonblock(fd)) {
            close(fd);
            continue;
        }
        dtr__rdzv_sockopts(fd);
        c = dtr__fed_conn_open(s, fd, peer);
        if (!c) {
            dtr__fed_log(&s->cfg, DTR_LOG_WARN, "federated server: refused %s: %d connections (max_clients)", peer,
                         s->nconns);
            close(fd);
            continue;
        }
        c->deadline_ms = dtr__rdzv_now_ms() + 10000;
    }
}

/* Sends what is queued; 0 when the connection is gone. */
static int dtr__fed_flush(dtr__fed_conn *c) {
    while (c->out_pos < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_pos, c->out_len - c->out_pos, DTR__RDZV_NOSIGNAL);
        if (k > 0) c->out_pos += (size_t)k;
        else if (k < 0 && errno == EINTR) continue;
        else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
        else return 0;
    }
    return 1;
}

/* Reads what is there; 0 when the connection is gone. */
static int dtr__fed_read(dtr__fed_core *s, dtr__fed_conn *c) {
    uint8_t buf[65536];
    for (;;) {
        ssize_t k = recv(c->fd, buf, sizeof buf, 0);
        if (k > 0) {
            dtr__fed_conn_feed(s, c, buf, (size_t)k);
            if (c->state == DTR__FED_C_CLOSING) return 1;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
        return 0;
    }
}

/* Removes connections that are closing (once their output is sent) or past the join deadline. */
static void dtr__fed_reap(dtr_fed_server *srv) {
    dtr__fed_core *s = &srv->core;
    int64_t now = dtr__rdzv_now_ms();
    int i;
    for (i = s->nconns - 1; i >= 0; i--) {
        dtr__fed_conn *c = s->conns[i];
        int done = c->state == DTR__FED_C_CLOSING && (c->out_pos == c->out_len || c->fd < 0);
        if (c->state == DTR__FED_C_AUTH && now > c->deadline_ms) done = 1;
        if (c->state == DTR__FED_C_CLOSING && now > c->deadline_ms + 2000) done = 1;
        if (done) dtr__fed_conn_close(s, c);
    }
}

static int dtr__fed_grow_pfd(dtr_fed_server *srv, int n) {
    struct pollfd *p;
    int cap = srv->pcap ? srv->pcap : 32;
    if (n <= srv->pcap) return 1;
    while (cap < n) cap *= 2;
    p = (struct pollfd *)dtr__realloc(&srv->core.cfg.alloc, srv->pfd, (size_t)cap * sizeof *p);
    if (!p) return 0;
    srv->pfd = p;
    srv->pcap = cap;
    return 1;
}

/* Serves sockets for up to timeout_ms (one poll). */
static void dtr__fed_pump(dtr_fed_server *srv, int timeout_ms) {
    dtr__fed_core *s = &srv->core;
    int i, n = srv->nlfd + s->nconns, nc = s->nconns;
    if (!dtr__fed_grow_pfd(srv, n)) {
        dtr__rdzv_sleep_ms(timeout_ms < 10 ? timeout_ms : 10);
        return;
    }
    for (i = 0; i < srv->nlfd; i++) {
        srv->pfd[i].fd = srv->lfd[i];
        srv->pfd[i].events = POLLIN;
        srv->pfd[i].revents = 0;
    }
    for (i = 0; i < nc; i++) {
        dtr__fed_conn *c = s->conns[i];
        struct pollfd *p = &srv->pfd[srv->nlfd + i];
        p->fd = c->fd;
        p->events = (short)((c->state != DTR__FED_C_CLOSING ? POLLIN : 0) | (c->out_pos < c->out_len ? POLLOUT : 0));
        p->revents = 0;
    }
    if (poll(srv->pfd, (nfds_t)n, timeout_ms) <= 0) {
        dtr__fed_reap(srv);
        return;
    }
    for (i = 0; i < nc; i++) {   /* conns[] is stable until the reap below */
        dtr__fed_conn *c = s->conns[i];
        short re = srv->pfd[srv->nlfd + i].revents;
        int ok = 1;
        if (re & (POLLIN | POLLHUP | POLLERR)) ok = dtr__fed_read(s, c);
        if (ok && (re & POLLOUT)) ok = dtr__fed_flush(c);
        if (!ok) {
            if (c->state == DTR__FED_C_LIVE) dtr__fed_drop(s, c, "connection lost");
            c->state = DTR__FED_C_CLOSING;
            c->out_pos = c->out_len;
        }
    }
    for (i = 0; i < srv->nlfd; i++)
        if (srv->pfd[i].revents & POLLIN) dtr__fed_accept(srv, srv->lfd[i]);
    dtr__fed_reap(srv);
}

static int dtr__fed_count(const dtr__fed_core *s, int idle_only) {
    int i, n = 0;
    for (i = 0; i < s->nconns; i++)
        n += s->conns[i]->state == DTR__FED_C_LIVE && (!idle_only || s->conns[i]->task < 0);
    return n;
}

dtr_result dtr_fed_server_wait_clients(dtr_fed_server *s, int n, int timeout_ms) {
    int64_t deadline;
    if (!s) return DTR_NULL_HANDLE;
    deadline = dtr__rdzv_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    for (;;) {
        int left = dtr__rdzv_left_ms(deadline);
        if (dtr__fed_count(&s->core, 0) >= n) return DTR_OK;
        if (left == 0) break;
        dtr__fed_pump(s, left < 50 ? left : 50);
    }
    snprintf(s->core.err, sizeof s->core.err, "federated server: %d of %d clients live after %d ms",
             dtr__fed_count(&s->core, 0), n, timeout_ms);
    return DTR_TIMEOUT;
}

/* ---- listening ---- */

static dtr_result dtr__fed_listen(dtr_fed_server *srv, char *err, size_t errlen) {
    const dtr_fed_server_config *cfg = &srv->core.cfg;
    dtr__rdzv_addr addrs[DTR__FED_MAX_LISTEN];
    char why[300];
    int n, i, retry, port = cfg->port, e = 0;
    n = dtr__rdzv_resolve(cfg->bind_addr, port, addrs, DTR__FED_MAX_LISTEN, why, sizeof why, &retry);
    if (n == 0) return dtr__errf(err, errlen, DTR_IO_ERROR, "federated server: bind address: %s", why);
    for (i = 0; i < n; i++) {
        int one = 1, fd = socket(addrs[i].ss.ss_family, SOCK_STREAM, 0);
        if (fd < 0) { e = errno; continue; }
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, (socklen_t)sizeof one);
        dtr__rdzv_set_port(&addrs[i], port);
        if (bind(fd, (struct sockaddr *)(void *)&addrs[i].ss, addrs[i].len) != 0 || listen(fd, SOMAXCONN) != 0 ||
            !dtr__rdzv_nonblock(fd)) {
            e = errno;
            close(fd);
            continue;
        }
        if (port == 0) {
            struct sockaddr_storage ss;
            socklen_t sl = (socklen_t)sizeof ss;
            if (getsockname(fd, (struct sockaddr *)(void *)&ss, &sl) == 0)
                port = ss.ss_family == AF_INET ? ntohs(((struct sockaddr_in *)(void *)&ss)->sin_port)
                                               : ntohs(((struct sockaddr_in6 *)(void *)&ss)->sin6_port);
        }
        srv->lfd[srv->nlfd++] = fd;
    }
    if (srv->nlfd == 0)
        return dtr__errf(err, errlen, DTR_IO_ERROR, "federated server: cannot listen on %s port %d: %s", cfg->bind_addr,
                         cfg->port, strerror(e));
    srv->port = port;
    return DTR_OK;
}

/* ---- checkpoint ---- */

static void dtr__fed_st_entry(dtr_st_entry *e, const char *name, dtr_dtype dt, int64_t n) {
    memset(e, 0, sizeof *e);
    snprintf(e->name, sizeof e->name, "%s", name);
    e->dtype = dt;
    e->ndim = 1;
    e->shape[0] = n;
}

static dtr_result dtr__fed_save(dtr_fed_server *srv, char *err, size_t errlen) {
    dtr__fed_core *s = &srv->core;
    dtr_st_entry e[4];
    const void *data[4];
    int32_t meta[6];
    int n = 0;
    meta[0] = (int32_t)(s->round & 0x7fffffff);
    meta[1] = (int32_t)(s->round >> 31);
    meta[2] = (int32_t)(s->task_seq & 0x7fffffff);
    meta[3] = (int32_t)(s->task_seq >> 31);
    meta[4] = (int32_t)s->cfg.server_opt;
    meta[5] = DTR__FED_VERSION;
    dtr__fed_st_entry(&e[n], "fed.state", DTR_I32, 6); data[n++] = meta;
    dtr__fed_st_entry(&e[n], "fed.weights", DTR_F32, s->numel); data[n++] = srv->w;
    if (srv->opt.m) { dtr__fed_st_entry(&e[n], "fed.opt.m", DTR_F32, s->numel); data[n++] = srv->opt.m; }
    if (srv->opt.v) { dtr__fed_st_entry(&e[n], "fed.opt.v", DTR_F32, s->numel); data[n++] = srv->opt.v; }
    return dtr_st_write(s->cfg.checkpoint_path, e, data, n, err, errlen);
}

static const dtr_st_entry *dtr__fed_st_find(const dtr_st_file *f, const char *name, dtr_dtype dt, int64_t n) {
    int i;
    for (i = 0; i < f->count; i++) {
        const dtr_st_entry *e = &f->entries[i];
        if (strcmp(e->name, name) == 0)
            return (!e->foreign && e->dtype == dt && e->ndim == 1 && e->shape[0] == n) ? e : NULL;
    }
    return NULL;
}

/* Reads the checkpoint when there is one. */
static dtr_result dtr__fed_load(dtr_fed_server *srv, char *err, size_t errlen) {
    dtr__fed_core *s = &srv->core;
    dtr_st_file f;
    const dtr_st_entry *st, *w, *m, *v;
    int32_t meta[6];
    dtr_result r;
    if (!s->cfg.checkpoint_path[0] || access(s->cfg.checkpoint_path, F_OK) != 0) return DTR_OK;
    if ((r = dtr_st_open(s->cfg.checkpoint_path, &s->cfg.alloc, &f, err, errlen)) != DTR_OK) return r;
    st = dtr__fed_st_find(&f, "fed.state", DTR_I32, 6);
    w = dtr__fed_st_find(&f, "fed.weights", DTR_F32, s->numel);
    m = dtr__fed_st_find(&f, "fed.opt.m", DTR_F32, s->numel);
    v = dtr__fed_st_find(&f, "fed.opt.v", DTR_F32, s->numel);
    if (!st || !w || (srv->opt.m && !m) || (srv->opt.v && !v)) {
        dtr_st_destroy(&f);
        return dtr__errf(err, errlen, DTR_SHAPE_MISMATCH,
                         "federated server: checkpoint %s is not a server state of %lld values with this server_opt",
                         s->cfg.checkpoint_path, (long long)s->numel);
    }
    memcpy(meta, st->data, sizeof meta);
    s->round = (int64_t)meta[0] | ((int64_t)meta[1] << 31);
    s->task_seq = (uint64_t)meta[2] | ((uint64_t)meta[3] << 31);
    memcpy(srv->w, w->data, (size_t)s->numel * sizeof(float));
    if (srv->opt.m) memcpy(srv->opt.m, m->data, (size_t)s->numel * sizeof(float));
    if (srv->opt.v) memcpy(srv->opt.v, v->data, (size_t)s->numel * sizeof(float));
    dtr_st_destroy(&f);
    dtr__fed_log(&s->cfg, DTR_LOG_INFO, "federated server: resumed at round %lld from %s", (long long)s->round,
                 s->cfg.checkpoint_path);
    return DTR_OK;
}

/* ---- create / destroy ---- */

dtr_fed_server_config dtr_fed_server_config_init(void) {
    dtr_fed_server_config c;
    memset(&c, 0, sizeof c);
    dtr__fed_defaults(&c);
    c.server_lr = 0.0f;   /* resolved at create: it depends on server_opt */
    c.log_level = DTR_LOG_WARN;
    return c;
}

static dtr_result dtr__fed_server_alloc(dtr_fed_server *srv) {
    const dtr_allocation_callbacks *a = &srv->core.cfg.alloc;
    size_t n = (size_t)srv->core.numel;
    int k = srv->core.nslots;
    srv->w = (float *)dtr__malloc(a, n * sizeof(float));
    srv->d = (float *)dtr__malloc(a, n * sizeof(float));
    srv->tmp = (float *)dtr__malloc(a, (size_t)k * sizeof(float));
    srv->idx = (int *)dtr__malloc(a, (size_t)k * sizeof(int));
    srv->wire = (uint8_t *)dtr__malloc(a, n * sizeof(float));
    if (srv->core.cfg.server_opt != DTR_FED_OPT_AVG) srv->opt.m = (float *)dtr__calloc(a, n * sizeof(float));
    if (srv->core.cfg.server_opt == DTR_FED_OPT_ADAM) srv->opt.v = (float *)dtr__calloc(a, n * sizeof(float));
    if (!srv->w || !srv->d || !srv->tmp || !srv->idx || !srv->wire ||
        (srv->core.cfg.server_opt != DTR_FED_OPT_AVG && !srv->opt.m) ||
        (srv->core.cfg.server_opt == DTR_FED_OPT_ADAM && !srv->opt.v))
        return DTR_OUT_OF_MEMORY;
    return DTR_OK;
}

static void dtr__fed_server_free(dtr_fed_server *srv) {
    dtr_allocation_callbacks a = srv->core.cfg.alloc;
    int i;
    for (i = 0; i < srv->nlfd; i++) close(srv->lfd[i]);
    dtr__fed_core_free(&srv->core);
    dtr__free(&a, srv->w);
    dtr__free(&a, srv->d);
    dtr__free(&a, srv->tmp);
    dtr__free(&a, srv->idx);
    dtr__free(&a, srv->wire);
    dtr__free(&a, srv->opt.m);
    dtr__free(&a, srv->opt.v);
    dtr__free(&a, srv->pfd);
    dtr__free(&a, srv);
}

dtr_result dtr_fed_server_create(const dtr_fed_server_config *cfg, const float *weights, int64_t numel,
                                 dtr_fed_server **out, char *err, size_t errlen) {
    dtr_fed_server *srv;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (out) *out = NULL;
    if (!cfg || !weights || !out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "federated server: cfg, weights or out is NULL");
    srv = (dtr_fed_server *)dtr__calloc(&cfg->alloc, sizeof *srv);
    if (!srv) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "federated server: out of memory");
    if ((r = dtr__fed_core_init(&srv->core, cfg, numel, err, errlen)) != DTR_OK) {
        dtr__free(&cfg->alloc, srv);
        return r;
    }
    if ((r = dtr__fed_server_alloc(srv)) != DTR_OK) {
        dtr__fed_server_free(srv);
        return dtr__errf(err, errlen, r, "federated server: out of memory for %lld values", (long long)numel);
    }
    memcpy(srv->w, weights, (size_t)numel * sizeof(float));
    if ((r = dtr__fed_load(srv, err, errlen)) != DTR_OK || (r = dtr__fed_listen(srv, err, errlen)) != DTR_OK) {
        dtr__fed_server_free(srv);
        return r;
    }
    dtr_rng_seed(&srv->rng, srv->core.cfg.seed, 7);
    *out = srv;
    return DTR_OK;
}

void dtr_fed_server_destroy(dtr_fed_server *s) {
    int64_t deadline;
    int i;
    if (!s) return;
    for (i = 0; i < s->core.nconns; i++) {
        dtr__fed_conn *c = s->core.conns[i];
        if (c->state == DTR__FED_C_LIVE) {
            dtr__fed_hdr h;
            memset(&h, 0, sizeof h);
            h.type = DTR__FED_BYE;
            (void)dtr__fed_queue_msg(&s->core, c, &h, NULL);
            c->state = DTR__FED_C_CLOSING;
            c->deadline_ms = dtr__rdzv_now_ms();
        }
    }
    deadline = dtr__rdzv_now_ms() + 2000;
    while (s->core.nconns > 0 && dtr__rdzv_left_ms(deadline) > 0) dtr__fed_pump(s, 20);
    dtr__fed_server_free(s);
}

/* ---- rounds ---- */

static int dtr__fed_idle(const dtr__fed_conn *c) { return c->state == DTR__FED_C_LIVE && c->task < 0; }

/* Samples min(K, idle) idle live clients uniformly (each is taken with probability
 * slots left / candidates left) and queues the task for them. Returns how many. */
static int dtr__fed_start_attempt(dtr_fed_server *srv) {
    dtr__fed_core *s = &srv->core;
    dtr__fed_hdr h;
    int i, left = dtr__fed_count(s, 1), k = 0;
    uint32_t mu_bits, lr_bits;
    memset(&h, 0, sizeof h);
    h.type = DTR__FED_TASK;
    h.codec = (int)s->cfg.codec;
    h.epochs = (uint32_t)s->cfg.local_epochs;
    h.round = (uint64_t)s->round;
    h.task = s->cur_task = ++s->task_seq;
    memcpy(&mu_bits, &s->cfg.mu, 4);
    memcpy(&lr_bits, &s->cfg.client_lr, 4);
    h.arg = ((uint64_t)mu_bits << 32) | lr_bits;
    h.len = (uint64_t)s->numel * dtr__fed_codec_size(h.codec);
    dtr__fed_encode(h.codec, srv->w, s->numel, srv->wire);
    memset(s->slot_samples, 0, (size_t)s->nslots * sizeof(uint64_t));
    memset(s->slot_clipped, 0, (size_t)s->nslots * sizeof(int));
    for (i = 0; i < s->nconns && left > 0; i++) {
        dtr__fed_conn *c = s->conns[i];
        if (!dtr__fed_idle(c)) continue;
        if (dtr_rng_u32(&srv->rng) % (uint32_t)left-- < (uint32_t)(s->nslots - k)) {
            c->slot = k++;
            c->task = (int64_t)h.task;
            if (!dtr__fed_queue_msg(s, c, &h, srv->wire)) dtr__fed_drop(s, c, "out of memory");
        }
    }
    return k;
}

/* One attempt: waits for enough idle clients, sends the task, collects until all answered
 * or the deadline. Returns the number of accepted updates. */
static int dtr__fed_attempt(dtr_fed_server *srv) {
    dtr__fed_core *s = &srv->core;
    int64_t deadline = dtr__rdzv_now_ms() + s->cfg.join_timeout_ms;
    int sampled, i;
    while (dtr__fed_count(s, 1) < s->cfg.min_updates && dtr__rdzv_left_ms(deadline) > 0)
        dtr__fed_pump(srv, 50);
    if (dtr__fed_count(s, 1) < s->cfg.min_updates) return 0;
    sampled = dtr__fed_start_attempt(srv);
    s->st.sampled = sampled;
    deadline = dtr__rdzv_now_ms() + s->cfg.round_timeout_ms;
    for (;;) {
        int pending = 0;
        for (i = 0; i < s->nconns; i++) pending += s->conns[i]->slot >= 0 && s->conns[i]->state == DTR__FED_C_LIVE;
        if (pending == 0 || dtr__rdzv_left_ms(deadline) == 0) break;
        dtr__fed_pump(srv, dtr__rdzv_left_ms(deadline) < 50 ? dtr__rdzv_left_ms(deadline) : 50);
    }
    for (i = 0; i < s->nconns; i++) s->conns[i]->slot = -1;   /* what comes now is late */
    s->cur_task = 0;
    for (i = 0, s->st.accepted = 0, s->st.clipped = 0; i < s->nslots; i++)
        if (s->slot_samples[i]) {
            srv->idx[s->st.accepted++] = i;
            s->st.clipped += s->slot_clipped[i];
        }
    return s->st.accepted;
}

static void dtr__fed_finish_round(dtr_fed_server *srv) {
    dtr__fed_core *s = &srv->core;
    int m = s->st.accepted, k;
    double ss = 0.0;
    int64_t i;
    dtr__fed_aggregate(s, srv->idx, m, srv->d, srv->tmp);
    if (s->cfg.dp_noise_multiplier > 0.0f) dtr__fed_add_noise(s, srv->idx, m, srv->d);
    for (i = 0; i < s->numel; i++) ss += (double)srv->d[i] * (double)srv->d[i];
    s->st.update_norm = sqrt(ss);
    for (k = 0, s->st.samples = 0; k < m; k++) s->st.samples += s->slot_samples[srv->idx[k]];
    dtr__fed_apply(&s->cfg, &srv->opt, srv->w, srv->d, s->numel);
    s->st.round = s->round++;
}

dtr_result dtr_fed_server_round(dtr_fed_server *s, dtr_fed_round_stats *stats) {
    dtr__fed_core *c;
    int64_t t0;
    dtr_result r = DTR_OK;
    if (!s) return DTR_NULL_HANDLE;
    c = &s->core;
    t0 = dtr__rdzv_now_ms();
    memset(&c->st, 0, sizeof c->st);
    c->st.round = c->round;
    c->err[0] = '\0';
    while (c->st.attempts < c->cfg.max_attempts) {
        c->st.attempts++;
        if (dtr__fed_attempt(s) >= c->cfg.min_updates) break;
        dtr__fed_log(&c->cfg, DTR_LOG_WARN, "federated server: round %lld attempt %d: %d updates (min_updates %d); repeating",
                     (long long)c->round, c->st.attempts, c->st.accepted, c->cfg.min_updates);
    }
    if (c->st.accepted < c->cfg.min_updates) {
        snprintf(c->err, sizeof c->err, "federated server: round %lld: %d attempts each had fewer than %d updates "
                 "(%d live clients)", (long long)c->round, c->st.attempts, c->cfg.min_updates, dtr__fed_count(c, 0));
        r = DTR_TIMEOUT;
    } else {
        dtr__fed_finish_round(s);
        if (c->cfg.checkpoint_path[0] && c->round % c->cfg.checkpoint_every == 0 &&
            (r = dtr__fed_save(s, c->err, sizeof c->err)) != DTR_OK)
            dtr__fed_log(&c->cfg, DTR_LOG_ERROR, "%s", c->err);
    }
    c->st.live_clients = dtr__fed_count(c, 0);
    c->st.seconds = (double)(dtr__rdzv_now_ms() - t0) / 1000.0;
    if (stats) *stats = c->st;
    return r;
}

const float *dtr_fed_server_weights(const dtr_fed_server *s) { return s ? s->w : NULL; }
int64_t dtr_fed_server_round_index(const dtr_fed_server *s) { return s ? s->core.round : -1; }
int dtr_fed_server_live_clients(const dtr_fed_server *s) { return s ? dtr__fed_count(&s->core, 0) : -1; }
int dtr_fed_server_port(const dtr_fed_server *s) { return s ? s->port : 0; }
const char *dtr_fed_server_last_error(const dtr_fed_server *s) { return s ? s->core.err : "federated server: NULL"; }

/* ======================================================================
 * The client.
 * ====================================================================*/

struct dtr_fed_client {
    dtr_fed_client_config cfg;
    int64_t numel;
    int fd;
    uint8_t key[32];
    uint64_t seq_in, seq_out;
    uint8_t *buf;                    /* one message body */
    size_t buf_cap;
    float *global;                   /* the weights of the pending task */
    float *delta;
    uint64_t task;                   /* pending task id; 0: none */
    int64_t round;
    char err[512];
};

static dtr_result dtr__fed_cfail(dtr_fed_client *c, dtr_result r, const char *fmt, ...) DTR__PRINTF(3, 4);
static dtr_result dtr__fed_cfail(dtr_fed_client *c, dtr_result r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return r;
}

static void dtr__fed_cclose(dtr_fed_client *c) {
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->task = 0;
}

/* Connects one address (bounded by the deadline); the socket or -1 with the reason. */
static int dtr__fed_connect_addr(const dtr__rdzv_addr *a, int64_t deadline, char *why, size_t whylen) {
    int e = 0, fd = socket(a->ss.ss_family, SOCK_STREAM, 0);
    if (fd < 0 || !dtr__rdzv_nonblock(fd)) {
        snprintf(why, whylen, "socket: %s", strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    dtr__rdzv_sockopts(fd);
    if (connect(fd, (const struct sockaddr *)(const void *)&a->ss, a->len) != 0) {
        struct pollfd pf;
        socklen_t sl = (socklen_t)sizeof e;
        int rc;
        if (errno != EINPROGRESS && errno != EINTR) e = errno;
        pf.fd = fd;
        pf.events = POLLOUT;
        pf.revents = 0;
        if (!e) {
            rc = poll(&pf, 1, dtr__rdzv_left_ms(deadline) < 5000 ? dtr__rdzv_left_ms(deadline) : 5000);
            if (rc <= 0) e = rc == 0 ? ETIMEDOUT : errno;
            else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &sl) != 0) e = errno;
        }
        if (e) {
            snprintf(why, whylen, "connect: %s", strerror(e));
            close(fd);
            return -1;
        }
    }
    return fd;
}

/* The join handshake on a connected socket; *fatal when retrying is pointless. */
static dtr_result dtr__fed_handshake(dtr_fed_client *c, int fd, int64_t deadline, int *fatal) {
    uint8_t hello[DTR__FED_HELLO], join[DTR__FED_JOIN], wel[DTR__FED_WELCOME], mac[DTR__FED_MAC];
    size_t got;
    int e;
    uint32_t status;
    dtr_result r = dtr__rdzv_recv_all(fd, hello, sizeof hello, deadline, &got, &e);
    *fatal = 0;
    if (r != DTR_OK) return dtr__fed_cfail(c, r, "federated client: no greeting from the server");
    if (memcmp(hello, "DTFZ", 4) != 0 || dtr__rdzv_get32(hello + 4) != DTR__FED_VERSION)
        return *fatal = 1, dtr__fed_cfail(c, DTR_VERSION_MISMATCH, "federated client: not a dtrain federated server of this version");
    memcpy(join, "DTFJ", 4);
    dtr__rdzv_put32(join + 4, DTR__FED_VERSION);
    dtr__rdzv_put64(join + 8, c->cfg.client_id);
    dtr__rdzv_put64(join + 16, (uint64_t)c->numel);
    dtr__rdzv_random(join + 24, 32);
    dtr__fed_join_mac(c->cfg.secret, hello + 8, join, join + DTR__FED_JOIN_SIGNED);
    r = dtr__rdzv_send_all(fd, join, sizeof join, deadline, &e);
    if (r == DTR_OK) r = dtr__rdzv_recv_all(fd, wel, sizeof wel, deadline, &got, &e);
    if (r != DTR_OK) return dtr__fed_cfail(c, r, "federated client: the server dropped the join (full?)");
    status = dtr__rdzv_get32(wel + 4);
    *fatal = 1;
    if (memcmp(wel, "DTFW", 4) != 0) return dtr__fed_cfail(c, DTR_PEER_FAILED, "federated client: malformed welcome");
    if (status == DTR__FED_W_BAD_SECRET)
        return dtr__fed_cfail(c, DTR_INVALID_ARGUMENT, "federated client: the server refused the secret");
    if (status == DTR__FED_W_BAD_SHAPE)
        return dtr__fed_cfail(c, DTR_SHAPE_MISMATCH, "federated client: the server's model has %llu values, this one %lld",
                              (unsigned long long)dtr__rdzv_get64(wel + 16), (long long)c->numel);
    if (status != DTR__FED_W_OK) return dtr__fed_cfail(c, DTR_VERSION_MISMATCH, "federated client: join refused (%u)", status);
    dtr__fed_welcome_mac(c->cfg.secret, join + 24, hello + 8, wel, mac);
    if (!dtr__ct_equal(mac, wel + DTR__FED_WELCOME_SIGNED, DTR__FED_MAC))
        return dtr__fed_cfail(c, DTR_INVALID_ARGUMENT, "federated client: the server did not prove it knows the secret");
    dtr__fed_session_key(c->cfg.secret, hello + 8, join + 24, c->key);
    c->seq_in = c->seq_out = 0;
    *fatal = 0;
    return DTR_OK;
}

/* Resolves, connects and joins, retrying until the deadline. */
static dtr_result dtr__fed_join(dtr_fed_client *c, int64_t deadline) {
    int backoff = 10;
    char why[320];
    snprintf(why, sizeof why, "no answer");
    dtr__fed_cclose(c);
    for (;;) {
        dtr__rdzv_addr addrs[4];
        int i, retry = 0, fatal = 0, n;
        n = dtr__rdzv_resolve(c->cfg.server_addr, c->cfg.port, addrs, 4, why, sizeof why, &retry);
        if (n == 0 && !retry) return dtr__fed_cfail(c, DTR_IO_ERROR, "federated client: %s", why);
        for (i = 0; i < n; i++) {
            int fd = dtr__fed_connect_addr(&addrs[i], deadline, why, sizeof why);
            dtr_result r;
            if (fd < 0) continue;
            r = dtr__fed_handshake(c, fd, deadline, &fatal);
            if (r == DTR_OK) return c->fd = fd, DTR_OK;
            close(fd);
            if (fatal) return r;
            memcpy(why, c->err, sizeof why - 1);
            why[sizeof why - 1] = '\0';
        }
        if (dtr__rdzv_left_ms(deadline) == 0) break;
        dtr__rdzv_sleep_ms(backoff < dtr__rdzv_left_ms(deadline) ? backoff : dtr__rdzv_left_ms(deadline));
        if (backoff < 500) backoff *= 2;
    }
    return dtr__fed_cfail(c, DTR_TIMEOUT, "federated client: could not join %s:%d within %d ms: %s", c->cfg.server_addr,
                          c->cfg.port, c->cfg.timeout_ms, why);
}

dtr_fed_client_config dtr_fed_client_config_init(void) {
    dtr_fed_client_config c;
    memset(&c, 0, sizeof c);
    snprintf(c.server_addr, sizeof c.server_addr, "127.0.0.1");
    c.timeout_ms = 300000;
    return c;
}

dtr_result dtr_fed_client_create(const dtr_fed_client_config *cfg, int64_t numel, dtr_fed_client **out, char *err,
                                 size_t errlen) {
    dtr_fed_client *c;
    dtr_result r;
    size_t sl;
    if (err && errlen) err[0] = '\0';
    if (out) *out = NULL;
    if (!cfg || !out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "federated client: cfg or out is NULL");
    sl = dtr__fed_slen(cfg->secret, sizeof cfg->secret);
    if (sl == 0 || sl >= sizeof cfg->secret || cfg->port < 1 || cfg->port > 65535 || numel < 1 ||
        numel > DTR__FED_MAX_NUMEL || (unsigned)cfg->codec > DTR_FED_BF16 || cfg->timeout_ms < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "federated client: needs a secret, a port in 1..65535, numel in 1..2^31 and a known codec");
    c = (dtr_fed_client *)dtr__calloc(&cfg->alloc, sizeof *c);
    if (!c) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "federated client: out of memory");
    c->cfg = *cfg;
    if (!c->cfg.timeout_ms) c->cfg.timeout_ms = 300000;
    if (!c->cfg.server_addr[0]) snprintf(c->cfg.server_addr, sizeof c->cfg.server_addr, "127.0.0.1");
    if (!c->cfg.client_id) dtr__rdzv_random((uint8_t *)&c->cfg.client_id, sizeof c->cfg.client_id);
    c->numel = numel;
    c->fd = -1;
    c->global = (float *)dtr__malloc(&cfg->alloc, (size_t)numel * sizeof(float));
    c->delta = (float *)dtr__malloc(&cfg->alloc, (size_t)numel * sizeof(float));
    if (!c->global || !c->delta || !dtr__fed_reserve(&cfg->alloc, &c->buf, &c->buf_cap, (size_t)numel * 4 + DTR__FED_MAC))
        r = dtr__fed_cfail(c, DTR_OUT_OF_MEMORY, "federated client: out of memory");
    else
        r = dtr__fed_join(c, dtr__rdzv_now_ms() + c->cfg.timeout_ms);
    if (r != DTR_OK) {
        dtr__errf(err, errlen, r, "%s", c->err);
        dtr_fed_client_destroy(c);
        return r;
    }
    *out = c;
    return DTR_OK;
}

static dtr_result dtr__fed_csend(dtr_fed_client *c, const dtr__fed_hdr *h, const uint8_t *body) {
    uint8_t hdr[DTR__FED_HDR], mac[DTR__FED_MAC];
    int64_t deadline = dtr__rdzv_now_ms() + c->cfg.timeout_ms;
    dtr_result r;
    int e;
    dtr__fed_put_header(hdr, h);
    dtr__fed_frame_mac(c->key, 1, c->seq_out++, hdr, body, (size_t)h->len, mac);
    r = dtr__rdzv_send_all(c->fd, hdr, sizeof hdr, deadline, &e);
    if (r == DTR_OK && h->len) r = dtr__rdzv_send_all(c->fd, body, (size_t)h->len, deadline, &e);
    if (r == DTR_OK) r = dtr__rdzv_send_all(c->fd, mac, sizeof mac, deadline, &e);
    if (r != DTR_OK) {
        dtr__fed_cclose(c);
        return dtr__fed_cfail(c, r, "federated client: sending to the server: %s", e ? strerror(e) : "timed out");
    }
    return DTR_OK;
}

void dtr_fed_client_destroy(dtr_fed_client *c) {
    dtr_allocation_callbacks a;
    if (!c) return;
    if (c->fd >= 0) {
        dtr__fed_hdr h;
        memset(&h, 0, sizeof h);
        h.type = DTR__FED_BYE;
        c->cfg.timeout_ms = 1000;
        (void)dtr__fed_csend(c, &h, NULL);
    }
    dtr__fed_cclose(c);
    a = c->cfg.alloc;
    dtr__free(&a, c->buf);
    dtr__free(&a, c->global);
    dtr__free(&a, c->delta);
    dtr__free(&a, c);
}

/* Receives one message into c->buf; DTR_CORRUPT_FILE when it fails its checks. */
static dtr_result dtr__fed_crecv(dtr_fed_client *c, dtr__fed_hdr *h, int64_t deadline) {
    uint8_t hdr[DTR__FED_HDR], want[DTR__FED_MAC];
    char why[160];
    size_t got;
    int e;
    dtr_result r = dtr__rdzv_recv_all(c->fd, hdr, sizeof hdr, deadline, &got, &e);
    if (r == DTR_TIMEOUT && got == 0) return dtr__fed_cfail(c, r, "federated client: no task within %d ms", c->cfg.timeout_ms);
    if (r != DTR_OK) return dtr__fed_cclose(c), dtr__fed_cfail(c, DTR_PEER_FAILED, "federated client: connection lost");
    if (!dtr__fed_parse_header(hdr, c->numel, h, why, sizeof why))
        return dtr__fed_cclose(c), dtr__fed_cfail(c, DTR_CORRUPT_FILE, "federated client: bad message: %s", why);
    r = dtr__rdzv_recv_all(c->fd, c->buf, (size_t)h->len + DTR__FED_MAC, deadline, &got, &e);
    if (r != DTR_OK) return dtr__fed_cclose(c), dtr__fed_cfail(c, DTR_PEER_FAILED, "federated client: connection lost");
    dtr__fed_frame_mac(c->key, 0, c->seq_in++, hdr, c->buf, (size_t)h->len, want);
    if (!dtr__ct_equal(want, c->buf + h->len, DTR__FED_MAC))
        return dtr__fed_cclose(c), dtr__fed_cfail(c, DTR_CORRUPT_FILE, "federated client: a message failed its MAC");
    return DTR_OK;
}

dtr_result dtr_fed_client_next(dtr_fed_client *c, float *weights, dtr_fed_task *task) {
    int64_t deadline;
    dtr__fed_hdr h;
    dtr_result r;
    uint32_t mu_bits, lr_bits;
    if (!c || !weights || !task) return DTR_NULL_HANDLE;
    memset(task, 0, sizeof *task);
    deadline = dtr__rdzv_now_ms() + c->cfg.timeout_ms;
    c->task = 0;
    for (;;) {
        if (c->fd < 0) {
            if (c->cfg.no_reconnect) return dtr__fed_cfail(c, DTR_PEER_FAILED, "federated client: not connected");
            if ((r = dtr__fed_join(c, deadline)) != DTR_OK) return r;
        }
        r = dtr__fed_crecv(c, &h, deadline);
        if (r == DTR_OK) break;
        if (r == DTR_TIMEOUT || c->cfg.no_reconnect || dtr__rdzv_left_ms(deadline) == 0) return r;
    }
    if (h.type == DTR__FED_BYE) {
        dtr__fed_cclose(c);
        task->done = 1;
        return DTR_OK;
    }
    if (h.type != DTR__FED_TASK)
        return dtr__fed_cclose(c), dtr__fed_cfail(c, DTR_CORRUPT_FILE, "federated client: the server sent a non-task");
    dtr__fed_decode(h.codec, c->buf, c->numel, c->global);
    memcpy(weights, c->global, (size_t)c->numel * sizeof(float));
    mu_bits = (uint32_t)(h.arg >> 32);
    lr_bits = (uint32_t)h.arg;
    memcpy(&task->mu, &mu_bits, 4);
    memcpy(&task->lr, &lr_bits, 4);
    task->round = (int64_t)h.round;
    task->local_epochs = (int)h.epochs;
    c->task = h.task;
    c->round = task->round;
    return DTR_OK;
}

dtr_result dtr_fed_client_send(dtr_fed_client *c, const float *delta, uint64_t samples) {
    dtr__fed_hdr h;
    if (!c || !delta) return DTR_NULL_HANDLE;
    if (!c->task || c->fd < 0) return dtr__fed_cfail(c, DTR_BAD_STATE, "federated client: no task pending");
    if (!samples) return dtr__fed_cfail(c, DTR_INVALID_ARGUMENT, "federated client: an update needs samples >= 1");
    memset(&h, 0, sizeof h);
    h.type = DTR__FED_UPDATE;
    h.codec = (int)c->cfg.codec;
    h.round = (uint64_t)c->round;
    h.task = c->task;
    h.arg = samples;
    h.len = (uint64_t)c->numel * dtr__fed_codec_size(h.codec);
    dtr__fed_encode(h.codec, delta, c->numel, c->buf);
    c->task = 0;
    return dtr__fed_csend(c, &h, c->buf);
}

dtr_result dtr_fed_client_send_weights(dtr_fed_client *c, const float *weights, uint64_t samples) {
    int64_t i;
    if (!c || !weights) return DTR_NULL_HANDLE;
    for (i = 0; i < c->numel; i++) c->delta[i] = weights[i] - c->global[i];
    return dtr_fed_client_send(c, c->delta, samples);
}

const char *dtr_fed_client_last_error(const dtr_fed_client *c) { return c ? c->err : "federated client: NULL"; }

/* Test hook (tests/test_federated.c): sends an arbitrary message on an authenticated
 * connection, MAC'd with the session key, so tests can play a client that breaks the rules. */
dtr_result dtr__fed_client_send_raw(dtr_fed_client *c, int type, int codec, uint64_t task, uint64_t arg,
                                    const void *body, uint64_t len);
dtr_result dtr__fed_client_send_raw(dtr_fed_client *c, int type, int codec, uint64_t task, uint64_t arg,
                                    const void *body, uint64_t len) {
    dtr__fed_hdr h;
    if (!c || c->fd < 0) return DTR_BAD_STATE;
    memset(&h, 0, sizeof h);
    h.type = type;
    h.codec = codec;
    h.round = (uint64_t)c->round;
    h.task = task ? task : c->task;
    h.arg = arg;
    h.len = len;
    return dtr__fed_csend(c, &h, (const uint8_t *)body);
}

#ifdef __cplusplus
}
#endif

#endif /* !_WIN32 */

/* FedProx: the gradient of mu/2 ||w - global||^2 (portable); a device model's through host
   copies of its weights and gradients */
dtr_result dtr_fed_prox(dtr_model *m, const float *global, float mu) {
    dtr_context *ctx;
    float *w, *g;
    int64_t i, n;
    dtr_result r = DTR_OK;
    if (!m || !global) return DTR_NULL_HANDLE;
    ctx = dtr_model_context(m), w = dtr_model_params(m), g = dtr_model_grads(m), n = dtr_model_numel(m);
    if (!w || !g) return DTR_BAD_STATE;
    if (!dtr__host_memory(ctx)) {
        w = (float *)dtr__malloc(&ctx->alloc, (size_t)(2 * n + 1) * sizeof(float)), g = w ? w + n : NULL;
        if (!w) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_fed_prox: out of memory");
        if ((r = dtr_model_read(m, w, n)) == DTR_OK) r = dtr_model_read_grads(m, g, n);
    }
    for (i = 0; i < n && r == DTR_OK; i++) g[i] += mu * (w[i] - global[i]);
    if (w != dtr_model_params(m)) {
        if (r == DTR_OK) r = ctx->backend->from_host(ctx, dtr_model_grads(m), g, (size_t)n * sizeof(float));
        dtr__free(&ctx->alloc, w);
    }
    return r;
}
