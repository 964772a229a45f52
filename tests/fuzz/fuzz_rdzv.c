/* tests/fuzz/fuzz_rdzv.c: libFuzzer target for the rendezvous server's message handling
 * (src/rendezvous/wire.c), driven in memory without sockets: two connections are opened on
 * a server core, optionally authenticated with a valid join message, and the input is fed to
 * them in chunks. Input layout:
 *     byte 0        mode: bit 0 authenticates connection A, bit 1 connection B,
 *                   bits 4-5 the rank they claim (0..3; the world is 4)
 *     then chunks   one byte c (bit 7: connection B, else A; bits 0-6: length - 1), then that
 *                   many bytes for the connection (fewer at the end of the input)
 * Checked: no crash, leak or out-of-bounds access; every reply the server queues is well
 * formed (known status, bounded length); the table stays within max_keys and max_bytes; a
 * connection that broke a rule stops taking input and its refusal is logged with a reason.
 *     clang -g -O1 -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_rdzv.c -lm -lpthread
 *     ./a.out -max_total_time=60 tests/fuzz/corpus/rdzv */
#define DTRAIN_IMPLEMENTATION
#include "../../dtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int logged;

static void fuzz_log(void *user, dtr_log_level level, const char *msg) {
    (void)user;
    (void)level;
    if (strncmp(msg, "rendezvous server: ", 19) != 0 || strlen(msg) < 25) __builtin_trap();
    logged++;
}

/* Takes what the server queued for c and checks it: replies only (the greeting and the
 * welcome were taken before). */
static void drain_replies(dtr__rdzv_conn *c) {
    size_t p = c->out_pos;
    while (p < c->out_len) {
        uint32_t vlen;
        if (c->out_len - p < DTR__RDZV_HDR) __builtin_trap();
        vlen = dtr__rdzv_get32(c->out + p + 4);
        if (c->out[p] > DTR__RDZV_FULL || c->out[p + 1] || c->out[p + 2] || c->out[p + 3]) __builtin_trap();
        if (vlen > DTR_STORE_MAX_VALUE || c->out_len - p - DTR__RDZV_HDR < vlen) __builtin_trap();
        p += DTR__RDZV_HDR + vlen;
    }
    c->out_pos = c->out_len = 0;
}

/* Reads the greeting and, when asked, answers the challenge as a good client would. */
static void start(dtr__rdzv_server *s, dtr__rdzv_conn *c, int auth, uint32_t rank) {
    uint8_t msg[DTR__RDZV_AUTH_LEN], mac[DTR__RDZV_MAC];
    if (c->out_len != DTR__RDZV_HELLO_LEN || memcmp(c->out, "DTRZ", 4) != 0) __builtin_trap();
    c->out_pos = c->out_len = 0;
    if (!auth) return;
    memcpy(msg, "DTRA", 4);
    dtr__rdzv_put32(msg + 4, DTR__RDZV_VERSION);
    dtr__rdzv_put32(msg + 8, rank);
    dtr__rdzv_put32(msg + 12, 4);   /* the world size */
    dtr__rdzv_put32(msg + 16, 0);   /* the generation */
    dtr__rdzv_job_tag("", msg + 20);
    memset(msg + DTR__RDZV_AUTH_NONCE, 0x42, DTR__RDZV_NONCE);
    dtr__rdzv_auth_mac(s->cfg.secret, c->nonce, msg, msg + DTR__RDZV_AUTH_SIGNED);
    dtr__rdzv_conn_feed(s, c, msg, sizeof msg);
    if (c->state != DTR__RDZV_C_READY || c->out_len != DTR__RDZV_WELCOME_LEN || dtr__rdzv_get32(c->out + 4) != 0)
        __builtin_trap();
    dtr__rdzv_welcome_mac(s->cfg.secret, msg + DTR__RDZV_AUTH_NONCE, c->nonce, c->out, mac);
    if (memcmp(mac, c->out + DTR__RDZV_WELCOME_SIGNED, DTR__RDZV_MAC) != 0) __builtin_trap();
    c->out_pos = c->out_len = 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dtr_rendezvous_config cfg = dtr_rendezvous_config_init();
    dtr__rdzv_server s;
    dtr__rdzv_conn *conn[2];
    dtr__rdzv_req req;
    char why[160];
    int mode, k;
    size_t i;

    /* the header parser alone, on the first 12 bytes */
    if (size >= DTR__RDZV_HDR && !dtr__rdzv_parse_header(data, &req, why, sizeof why) && why[0] == '\0')
        __builtin_trap();

    snprintf(cfg.secret, sizeof cfg.secret, "fuzz-secret");
    cfg.world_size = 4;
    cfg.max_keys = 16;
    cfg.max_bytes = 4096;
    cfg.max_connections = 2;
    cfg.log = fuzz_log;
    cfg.log_level = DTR_LOG_DEBUG;
    if (dtr__rdzv_server_init(&s, &cfg) != DTR_OK) return 0;
    mode = size ? data[0] : 0;
    conn[0] = dtr__rdzv_conn_open(&s, -1, "fuzz-a");
    conn[1] = dtr__rdzv_conn_open(&s, -1, "fuzz-b");
    if (!conn[0] || !conn[1] || dtr__rdzv_conn_open(&s, -1, "third") != NULL) __builtin_trap();   /* max 2 */
    start(&s, conn[0], mode & 1, (uint32_t)(mode >> 4) & 3);
    start(&s, conn[1], mode & 2, (uint32_t)(mode >> 4) & 3);

    for (i = 1; i < size;) {
        int which = data[i] >> 7;
        size_t n = (size_t)(data[i] & 0x7f) + 1;
        dtr__rdzv_conn *c = conn[which];
        i++;
        if (n > size - i) n = size - i;
        if (c) {
            int before = logged, was = c->state;
            dtr__rdzv_conn_feed(&s, c, data + i, n);
            if (c->state == DTR__RDZV_C_CLOSING) {
                if (was != DTR__RDZV_C_CLOSING && logged == before) __builtin_trap();   /* no reason logged */
                if (dtr__rdzv_conn_want(c) != 0) __builtin_trap();
                conn[which] = NULL;   /* the socket layer would close it now */
                dtr__rdzv_conn_close(&s, c);
            } else if (c->state == DTR__RDZV_C_READY) {
                if (c->frame_len && (c->in_len >= c->frame_len || c->frame_len > DTR__RDZV_MAX_FRAME)) __builtin_trap();
                if (!c->frame_len && c->in_len >= DTR__RDZV_HDR) __builtin_trap();
            } else if (c->in_len >= DTR__RDZV_AUTH_LEN) {
                __builtin_trap();
            }
        }
        for (k = 0; k < 2; k++) {
            if (!conn[k]) continue;
            if (conn[k]->state == DTR__RDZV_C_READY) drain_replies(conn[k]);
            else conn[k]->out_pos = conn[k]->out_len = 0;   /* a welcome (refusal) */
        }
        if (s.nkeys > (size_t)s.cfg.max_keys || s.nbytes > s.cfg.max_bytes) __builtin_trap();
        i += n;
    }
    dtr__rdzv_server_free(&s);
    return 0;
}
