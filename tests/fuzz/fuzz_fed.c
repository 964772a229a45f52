/* tests/fuzz/fuzz_fed.c: libFuzzer target for the federated server's message handling
 * (src/fed/federated.c), driven in memory without sockets on a server core with a model of
 * 6 values and 2 update slots. Input layout:
 *     byte 0   mode: 0 raw bytes before the join (the join parser);
 *                    1 raw bytes after a valid join (header parser, bounds, MAC check);
 *                    2 after a valid join and a task, the rest is the body of an UPDATE
 *                      with a valid MAC (decode, finite and norm checks, clipping);
 *                    anything else: as 1, in chunks of (byte 1 & 31) + 1
 * Checked: no crash, leak or out-of-bounds access; a connection that broke a rule stops
 * taking input; an accepted update is finite, within max_update_norm and clipped.
 *     clang -g -O1 -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_fed.c -lm -lpthread
 *     ./a.out -max_total_time=60 tests/fuzz/corpus/fed */
#define DTRAIN_IMPLEMENTATION
#include "../../dtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define NUMEL 6

/* Joins as a good client would; returns the session key's connection ready for messages. */
static void join(dtr__fed_core *s, dtr__fed_conn *c) {
    uint8_t m[88];
    memcpy(m, "DTFJ", 4);
    dtr__rdzv_put32(m + 4, 1);
    dtr__rdzv_put64(m + 8, 7);
    dtr__rdzv_put64(m + 16, NUMEL);
    memset(m + 24, 0x42, 32);
    dtr__fed_join_mac(s->cfg.secret, c->nonce, m, m + 56);
    c->out_pos = c->out_len = 0;
    dtr__fed_conn_feed(s, c, m, sizeof m);
    if (c->state != 1 || c->out_len != 56 || memcmp(c->out, "DTFW", 4) != 0) __builtin_trap();
    c->out_pos = c->out_len = 0;
}

/* An UPDATE for the connection's task whose body is the fuzz input (padded or cut to size). */
static void update(dtr__fed_core *s, dtr__fed_conn *c, const uint8_t *p, size_t n) {
    uint8_t msg[40 + NUMEL * 4 + 32];
    dtr__fed_hdr h;
    memset(&h, 0, sizeof h);
    memset(msg, 0, sizeof msg);
    h.type = 2;
    h.codec = n > 0 && (p[0] & 1) ? 1 : 0;
    h.task = 1;
    h.arg = n > 1 ? p[1] : 1;
    h.len = NUMEL * (h.codec ? 2 : 4);
    memcpy(msg + 40, p, n < h.len ? n : (size_t)h.len);
    dtr__fed_put_header(msg, &h);
    dtr__fed_frame_mac(c->key, 1, c->seq_in, msg, msg + 40, (size_t)h.len, msg + 40 + h.len);
    c->task = 1;
    c->slot = 0;
    s->cur_task = 1;
    dtr__fed_conn_feed(s, c, msg, 40 + (size_t)h.len + 32);
}

static void check_slot(const dtr__fed_core *s) {
    double ss = 0.0;
    int i;
    if (!s->slot_samples[0]) return;
    for (i = 0; i < NUMEL; i++) {
        if (!isfinite(s->slots[i])) __builtin_trap();
        ss += (double)s->slots[i] * s->slots[i];
    }
    if (sqrt(ss) > 2.0 * 1.0001) __builtin_trap();   /* clip_norm */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dtr_fed_server_config cfg = dtr_fed_server_config_init();
    dtr__fed_core s;
    dtr__fed_conn *c;
    dtr__fed_hdr h;
    char why[160];
    int mode;
    if (size < 1) return 0;
    if (size >= 40 && !dtr__fed_parse_header(data, NUMEL, &h, why, sizeof why) && why[0] == '\0') __builtin_trap();
    snprintf(cfg.secret, sizeof cfg.secret, "fuzz-secret");
    cfg.clients_per_round = 2;
    cfg.max_clients = 2;
    cfg.clip_norm = 2.0f;
    cfg.max_update_norm = 100.0f;
    if (dtr__fed_core_init(&s, &cfg, NUMEL, why, sizeof why) != DTR_OK) __builtin_trap();
    c = dtr__fed_conn_open(&s, -1, "fuzz");
    if (!c) __builtin_trap();
    mode = data[0];
    data++;
    size--;
    if (mode == 0) {
        dtr__fed_conn_feed(&s, c, data, size);
    } else {
        join(&s, c);
        if (mode == 2) {
            update(&s, c, data, size);
            check_slot(&s);
        } else {
            size_t chunk = mode == 1 || size == 0 ? size : (size_t)(data[0] & 31) + 1, i;
            for (i = 0; i < size; i += chunk) {
                int was_closing = c->state == 2;
                size_t take = size - i < chunk ? size - i : chunk;
                dtr__fed_conn_feed(&s, c, data + i, take);
                if (was_closing && c->state != 2) __builtin_trap();
                if (!chunk) break;
            }
        }
    }
    dtr__fed_core_free(&s);
    return 0;
}
